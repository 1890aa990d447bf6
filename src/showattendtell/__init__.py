"""Show, Attend and Tell: image captioning with soft and hard visual attention."""

__version__ = "0.2.0"
__all__ = ["CaptionResult", "Captioner", "caption_images", "load_model"]


def __getattr__(name: str):
    # Imported lazily so that `sat --help` does not pay for importing torch.
    if name in __all__:
        from showattendtell.captioning import captioner

        return getattr(captioner, name)
    raise AttributeError(name)
