"""Training: the model, its data, the inner AdamW loop, the outer Nesterov step and the DiLoCo loop."""
