"""Training: the LightningModule, the objectives and losses, and configs as a base plus overlays."""
