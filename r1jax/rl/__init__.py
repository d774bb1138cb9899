"""R1's post-training: rule-based rewards (rewards.py) for GRPO on verifiable tasks."""
