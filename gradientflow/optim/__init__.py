"""GradientFlow optim layer."""
