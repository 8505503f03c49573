"""GradientFlow observability layer."""
