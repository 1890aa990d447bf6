"""The web service (`sat serve`): a Gradio UI and API around showattendtell's captioner."""
