"""GradientFlow hooks layer."""
