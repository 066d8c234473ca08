"""What each pipeline family takes and how it steps: model cards, pipeline facts, steppers."""
