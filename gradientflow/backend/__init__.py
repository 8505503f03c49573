"""GradientFlow backend layer."""
