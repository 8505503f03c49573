"""GradientFlow engine layer."""
