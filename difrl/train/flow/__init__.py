"""The flow-matching recipe (trainer.py): its iteration plan, losses, method stages, reward backpropagation and rollout copy."""
