"""Captioning photos with a trained model: the Captioner, the models a user can name, the bulk
pipeline, its records and overlays, runs over several processes."""
