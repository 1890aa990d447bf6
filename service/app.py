"""The Gradio app behind `sat serve`: the Blocks layout, its events, and launching it.

The work is elsewhere in this package: ``worker`` (models and the batching worker thread),
``uploads`` (reading untrusted uploads, example photos), ``captioning`` (the function behind the
UI and the ``/caption`` API), ``events`` (the UI's handlers) and ``drawing`` (overlays on a
labelled colour scale).

Uploads reach the handlers as file paths inside Gradio's upload folder (every event runs with
``preprocess=False``), so Gradio never decodes them itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

import gradio as gr

from showattendtell.decoding import (
    HARD_MODES,
    MAX_BEAM_SIZE,
    MAX_CAPTION_LENGTH,
    MAX_LENGTH_PENALTY,
    RERANKERS,
)

from . import drawing, events
from .captioning import api_caption
from .uploads import MAX_EXAMPLES
from .worker import CaptionService

# Toasts at the bottom right, clear of the status line at the top of the page.
CSS = """
#caption-text textarea {font-size: 1.35em; font-weight: 600}
.toast-wrap {top: auto !important; bottom: var(--size-4) !important}
"""

API_DESCRIPTION = ("Caption an image: caption, words, score, top beams, each word's attention grid "
                   "(and hard-attention locations), the decoding settings used and a warning for "
                   "a degenerate photo. Options left out (None) are the model's defaults; a value "
                   "out of range is an error.")


def build_app(service: CaptionService, examples: Sequence[Path] = (),
              concurrency: int = 8) -> gr.Blocks:
    """The UI (upload -> caption, word overlays, beams) and the /caption API endpoint."""
    names = service.names
    default = service.get(None)
    d = default.decoding

    def model_choice(name: str) -> tuple[str, str]:
        return (f"{name} ({service.get(name).attention_type} attention)", name)

    with gr.Blocks(title="Show, Attend and Tell") as app:
        gr.Markdown("# Show, Attend and Tell\nUpload, paste or pick a photo: the model writes a "
                    "caption and shows, for every word, where in the image it looked.")
        state = gr.State(None)
        with gr.Row():
            with gr.Column(scale=1):
                image = gr.Image(label="Image", type="filepath", image_mode=None,
                                 sources=["upload", "clipboard"], height=360, elem_id="input-image")
                model = gr.Dropdown([model_choice(n) for n in names], value=names[0],
                                    label="Model", interactive=len(names) > 1, elem_id="model")
                with gr.Row():
                    beam = gr.Slider(1, MAX_BEAM_SIZE, value=d.beam_size, step=1,
                                     label="Beam size (1: greedy)", elem_id="beam-size")
                    length = gr.Slider(1, MAX_CAPTION_LENGTH, value=d.max_length, step=1,
                                       label="Maximum length (words)", elem_id="max-length")
                hard_mode = gr.Radio(events.HARD_MODE_CHOICES, value=d.hard_mode,
                                     label="Hard attention at inference",
                                     info="argmax and sample decode each word from one grid "
                                          "cell (framed in white); the expected context averages "
                                          "all cells by their weights, like soft attention",
                                     visible=default.attention_type == "hard",
                                     elem_id="hard-mode")
                with gr.Accordion("More decoding options", open=False):
                    penalty = gr.Slider(0, MAX_LENGTH_PENALTY, value=d.length_penalty, step=0.1,
                                        label="Length penalty (beams ranked by log p / "
                                              "length^penalty)", elem_id="length-penalty")
                    no_repeat = gr.Number(d.no_repeat_ngram, precision=0, minimum=0,
                                          maximum=MAX_CAPTION_LENGTH,
                                          label="No repeated n-grams of this size (0: allow)",
                                          elem_id="no-repeat-ngram")
                    rerank = gr.Radio(list(RERANKERS), value=d.rerank,
                                      label="Rerank the beam's captions",
                                      info="consensus: the one that best agrees with the "
                                           "captions of similar training photos",
                                      visible=default.model.consensus is not None,
                                      elem_id="rerank")
                button = gr.Button("Caption", variant="primary", elem_id="caption-button")
                gallery_examples = None
                if examples:
                    gallery_examples = gr.Examples(
                        [[str(p)] for p in examples], inputs=[image], label="Examples",
                        examples_per_page=MAX_EXAMPLES, elem_id="examples")
            with gr.Column(scale=2):
                status = gr.Markdown(events.PROMPT, elem_id="status")
                caption = gr.Textbox(label="Caption", interactive=False, elem_id="caption-text")
                words = gr.Radio([], label="Words: click one to see its attention",
                                 elem_id="words")
                scale = gr.Radio(drawing.SCALE_CHOICES, value="word", label="Colour scale",
                                 elem_id="colour-scale")
                view = gr.Image(label="Attention for the selected word", type="pil",
                                interactive=False, format="png", elem_id="word-view", height=400)
                note = gr.Markdown("", elem_id="scale-note")
        gallery = gr.Gallery(label="Every word's attention (click to step through)", columns=6,
                             height="auto", object_fit="contain", format="jpeg",
                             elem_id="word-gallery")
        sheet = gr.Image(label="The whole caption with all word overlays (each word on its own "
                               "colour scale: red = that word's largest weight)", type="pil",
                         interactive=False, format="jpeg", elem_id="caption-sheet")
        beams = gr.Dataframe(headers=["caption", "score"], label="Top beam captions",
                             interactive=False, elem_id="beams")

        # The /caption API: options default to None (the chosen model's defaults), unlike the
        # sliders, whose values are the first model's.
        api_model = gr.Dropdown(names, value=None, label="model", visible=False)
        api_beam = gr.Number(None, label="beam_size", visible=False)
        api_length = gr.Number(None, label="max_length", visible=False)
        api_hard = gr.Dropdown(list(HARD_MODES), value=None, label="hard_mode", visible=False)
        api_penalty = gr.Number(None, label="length_penalty", visible=False)
        api_no_repeat = gr.Number(None, label="no_repeat_ngram", visible=False)
        api_rerank = gr.Dropdown(list(RERANKERS), value=None, label="rerank", visible=False)
        api_out = gr.JSON(label="result", visible=False)
        api_button = gr.Button(visible=False)

        inputs = [image, model, beam, length, hard_mode, penalty, no_repeat, rerank, scale]
        outputs = [status, caption, state, gallery, words, view, note, sheet, beams]
        run = dict(fn=partial(events.ui_caption, service), inputs=inputs, outputs=outputs,
                   preprocess=False, concurrency_limit=concurrency, concurrency_id="caption",
                   api_visibility="private")
        # Not image.change: Gradio fires it twice when a new file replaces a shown one (so every
        # toast showed twice), and once more for an example. upload fires once per file.
        gr.on([button.click, image.upload], trigger_mode="always_last", **run)
        if gallery_examples is not None:
            gallery_examples.load_input_event.then(**run)
        # Removing the photo, or Gradio refusing an upload over the size limit, sets it to None.
        image.change(events.clear_outputs, inputs=[image], outputs=outputs, preprocess=False,
                     queue=False, api_visibility="private")
        model.change(partial(events.model_controls, service), inputs=[model],
                     outputs=[beam, length, hard_mode, penalty, no_repeat, rerank], queue=False,
                     api_visibility="private")
        # .input, not .change: only a click. The caption events set the word list and the first
        # word's view themselves; a .change they set off could land after a later event had
        # cleared the outputs (a rejected upload) and bring the old photo's view back.
        words.input(events.show_word, inputs=[state, words, scale], outputs=[view, note],
                    queue=False, api_visibility="private")
        scale.change(events.rescale, inputs=[state, words, scale], outputs=[gallery, view, note],
                     queue=False, api_visibility="private")

        def select_word(state_: dict | None, scale_: str, evt: gr.SelectData):
            """A gallery panel clicked: select its word and show it."""
            return (int(evt.index), *events.show_word(state_, int(evt.index), scale_))

        gallery.select(select_word, [state, scale], [words, view, note], queue=False,
                       api_visibility="private")
        api_button.click(partial(api_caption, service),
                         inputs=[image, api_model, api_beam, api_length, api_hard, api_penalty,
                                 api_no_repeat, api_rerank],
                         outputs=[api_out], api_name="caption", preprocess=False,
                         concurrency_limit=concurrency, concurrency_id="caption",
                         api_description=API_DESCRIPTION)
    return app


def launch(service: CaptionService, host: str = "127.0.0.1", port: int = 7860,
           max_upload_mb: float = 10.0, examples: Sequence[Path] = (), concurrency: int = 8,
           queue_size: int = 64, block: bool = True,
           auth: Sequence[tuple[str, str]] | None = None) -> gr.Blocks:
    """Build and start the app; ``block=False`` returns once it serves (tests, benchmarks).
    ``auth``: (user, password) pairs; the page and the API then need a login.

    Gradio copies the example photos into its cache when the app is built; requests can only
    name files in its upload folder or cache, so no other file on the machine is served or read.
    """
    service.max_upload_bytes = int(max_upload_mb * 2**20)
    app = build_app(service, examples, concurrency=concurrency)
    app.queue(max_size=queue_size)
    app.launch(server_name=host, server_port=port, max_file_size=int(max_upload_mb * 2**20),
               css=CSS, footer_links=["api"], auth=list(auth) if auth else None,
               prevent_thread_lock=not block, quiet=not block)
    return app
