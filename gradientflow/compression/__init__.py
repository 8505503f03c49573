"""GradientFlow compression layer."""
