"""The Gradio app behind `sat serve`: the Blocks layout, its events, and launching it.

The work is elsewhere in this package: ``worker`` (models and the batching worker thread),
``uploads`` (reading untrusted uploads, example photos), ``captioning`` (the function behind the
UI and the ``/caption`` API), ``events`` (the UI's handlers), ``options`` (the decoding controls
and API inputs, made from decoding.py's option table), ``drawing`` (overlays on a labelled
colour scale) and ``cache`` (the bound on Gradio's upload cache).

Uploads reach the handlers as file paths inside Gradio's upload folder (every event runs with
``preprocess=False``), so Gradio never decodes them itself.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import gradio as gr
from starlette.middleware import Middleware

from . import drawing, events, options
from .blocks import EXCEPTION_HANDLERS, ServiceBlocks, local_file_example
from .cache import CacheBound
from .capacity import gradio_threads
from .captioning import api_caption
from .guard import Guard, GuardMiddleware
from .uploads import MAX_EXAMPLES
from .worker import CaptionService

# Toasts at the bottom right, clear of the status line at the top of the page; the warning box
# stands out; the button the page presses when Gradio refuses a file type is never seen; the
# controls' help (the hard-attention modes; Gradio 6 draws it as .info-text) at body size and
# colour, not small pale grey; no broken image for a photo the browser cannot show
# (events.NOT_SHOWN: its preview shows below). On a phone (up to drawing.PHONE_WIDTH px; Gradio
# stacks the columns itself): the word gallery takes three panels a row (Gradio's minimum of
# 100 px a column pushed 3 of 9 off screen), the beam table's columns share the screen's width
# (BEAM_WIDTHS) in smaller type, and the caption sheet laid out for a phone replaces the wide
# one, whose labels would show at 5 px.
CSS = f"""
#caption-text textarea {{font-size: 1.35em; font-weight: 600}}
.toast-wrap {{top: auto !important; bottom: var(--size-4) !important}}
#caption-warning {{background: #fff4d6; border-left: 4px solid #e0a000; padding: 4px 10px}}
#refused-upload {{display: none !important}}
[data-testid="block-info"], .info-text {{
  font-size: var(--text-md) !important; color: var(--body-text-color) !important
}}
#beams {{overflow-x: auto}}
#input-image img[src$=".heic" i], #input-image img[src$=".heif" i],
#input-image img[src$=".tif" i], #input-image img[src$=".tiff" i] {{visibility: hidden}}
@media (min-width: {drawing.PHONE_WIDTH + 1}px) {{
  #caption-sheet-phone {{display: none !important}}
}}
@media (max-width: {drawing.PHONE_WIDTH}px) {{
  #word-gallery .grid-container {{grid-template-columns: repeat(3, minmax(0, 1fr)) !important}}
  #caption-sheet {{display: none !important}}
  #beams table {{font-size: var(--text-sm)}}
  #beams th, #beams td, #beams .cell-wrap {{
    padding-left: 2px !important; padding-right: 2px !important
  }}
}}
"""
BEAM_WIDTHS = ["12%", "42%", "24%", "22%"]  # rank, caption (wrapped), consensus, score: at
# 400 px each number and heading fits its column in the smaller type

# Gradio's page refuses a file that is not an image, or one over the upload limit, before
# uploading it, with a toast that fades and no event for the server: this reports the refusal
# (the toast's text) through a hidden button, so that the reason stays in the status line and
# the previous photo's outputs are cleared as for any other file that cannot be captioned.
REFUSAL_JS = """
() => {
  const counted = new WeakMap();  // toast -> the refusals it shows that were reported
  const refusal = /(Invalid file types?:|File\\(s\\) exceed the maximum allowed size)[^\\n]*/g;
  new MutationObserver(() => {
    for (const toast of document.querySelectorAll('.toast-body')) {
      // Gradio groups the toasts shown at once in one body, and a text may arrive after its
      // toast: a refusal counts once, when it appears, in a new toast or added to one shown
      const found = (toast.innerText || '').match(refusal) || [];
      const reported = counted.get(toast) || 0;
      counted.set(toast, found.length);  // fewer: a grouped message faded
      if (found.length <= reported) continue;
      window.__satRefused = found[found.length - 1];
      document.querySelector('#refused-upload')?.click();
    }
  }).observe(document.body, {childList: true, subtree: true, characterData: true});
}
"""

API_DESCRIPTION = (
    "Caption an image: caption, words, score, familiarity (0..1: how much the photo "
    "looks like the training photos), confidence (0..1: the chance that the caption is "
    "good), top beams in the order that decided "
    "(ranked_by), each word's attention grid (and hard-attention locations), the "
    "decoding settings that apply to the model and a warning for a caption likely "
    "wrong (an unfamiliar photo, an unsure caption) or a degenerate photo. Options "
    "left out (None) are the model's defaults; a value out of range is an error. The "
    "image is a file on the client's machine (gradio_client: handle_file('photo.jpg')) "
    "or inline as a data: URL; the server fetches no other URL."
)

RUNNING_ON = "Running on local URL:  "  # as `sat serve` says it
DEFAULT_SESSION_MINUTES = 60.0  # a browser session's captioned photo is kept this long


@dataclass
class Page:
    """The components the events connect."""

    image: gr.Image
    preview: gr.Image  # a converted preview of a photo the browser cannot show (HEIC)
    model: gr.Dropdown
    controls: dict[str, gr.Component]  # one per decoding option, in the table's order
    button: gr.Button
    examples: gr.Examples | None
    scale: gr.Radio
    outputs: dict[str, Any]  # events.OUTPUTS by name
    refused: gr.Button

    @property
    def output_list(self) -> list[Any]:
        return [self.outputs[name] for name in events.OUTPUTS]


def input_column(service: CaptionService, examples: Sequence[Path]) -> dict[str, Any]:
    """The photo, the model menu, the decoding controls, the button and the examples."""
    names = service.names

    def model_choice(name: str) -> tuple[str, str]:
        return (f"{name} ({service.get(name).attention_type} attention)", name)

    image = gr.Image(
        label="Image",
        type="filepath",
        image_mode=None,
        sources=["upload", "clipboard"],
        height=360,
        elem_id="input-image",
    )
    local_file_example(image)
    preview = gr.Image(
        label="Preview",
        type="pil",
        interactive=False,
        format="jpeg",
        height=360,
        visible=False,
        elem_id="input-preview",
    )
    model = gr.Dropdown(
        [model_choice(n) for n in names],
        value=names[0],
        label="Model",
        interactive=len(names) > 1,
        elem_id="model",
    )
    controls = options.controls(service.get(None))
    button = gr.Button("Caption", variant="primary", elem_id="caption-button")
    gallery_examples = None
    if examples:
        gallery_examples = gr.Examples(
            [[str(p)] for p in examples],
            inputs=[image],
            label="Examples",
            examples_per_page=MAX_EXAMPLES,
            elem_id="examples",
        )
    return dict(
        image=image,
        preview=preview,
        model=model,
        controls=controls,
        button=button,
        examples=gallery_examples,
    )


def output_column(session_ttl_s: float | None) -> tuple[gr.Radio, dict[str, Any]]:
    """Status, warning, caption, words, the colour scale and the selected word's view; the
    per-session state lives ``session_ttl_s`` seconds after its last change (None: until the
    page is closed)."""
    out: dict[str, Any] = {}
    out["status"] = gr.Markdown(events.PROMPT, elem_id="status")
    out["warning"] = gr.Markdown("", visible=False, elem_id="caption-warning")
    out["caption"] = gr.Textbox(label="Caption", interactive=False, elem_id="caption-text")
    out["state"] = gr.State(None, time_to_live=session_ttl_s)
    out["words"] = gr.Radio([], label="Words: click one to see its attention", elem_id="words")
    scale = gr.Radio(
        drawing.SCALE_CHOICES,
        value=drawing.DEFAULT_SCALE,
        label="Colour scale",
        elem_id="colour-scale",
    )
    out["view"] = gr.Image(
        label="Attention for the selected word",
        type="pil",
        interactive=False,
        format="png",
        elem_id="word-view",
        height=400,
    )
    out["note"] = gr.Markdown("", elem_id="scale-note")
    return scale, out


def layout(service: CaptionService, examples: Sequence[Path], session_ttl_s: float | None) -> Page:
    """The page: inputs on the left, the caption on the right, every word's overlay below."""
    gr.Markdown(
        "# Show, Attend and Tell\nUpload, paste or pick a photo: the model writes a "
        "caption and shows, for every word, where in the image it looked."
    )
    with gr.Row():
        with gr.Column(scale=1):
            inputs = input_column(service, examples)
        with gr.Column(scale=2):
            scale, out = output_column(session_ttl_s)
    out["gallery"] = gr.Gallery(
        label="Every word's attention (click to step through)",
        columns=6,
        height="auto",
        object_fit="contain",
        format="jpeg",
        elem_id="word-gallery",
    )
    out["sheet"] = gr.Image(
        label="The whole caption, every word on one colour scale (red = the largest weight of "
        "any word)",
        type="pil",
        interactive=False,
        format="jpeg",
        elem_id="caption-sheet",
    )
    # the same sheet laid out for a phone (drawing.sheets); CSS shows one of the two
    out["phone_sheet"] = gr.Image(
        label="The whole caption, one colour scale",  # short: clear of the image's buttons
        type="pil",
        interactive=False,
        format="jpeg",
        elem_id="caption-sheet-phone",
    )
    out["beams"] = gr.Dataframe(
        headers=events.BEAM_COLUMNS,
        label="Top beam captions",
        interactive=False,
        wrap=True,
        column_widths=BEAM_WIDTHS,
        elem_id="beams",
    )
    refused = gr.Button("refused upload", elem_id="refused-upload")
    return Page(scale=scale, outputs=out, refused=refused, **inputs)


def caption_fn(service: CaptionService) -> Callable[..., events.UIOutputs]:
    """The UI's caption event: (image, model, scale, *the controls' values in table order)."""

    def ui_caption(image: Any, model: str | None, scale: str, *values: Any) -> events.UIOutputs:
        return events.ui_caption(service, image, model, scale, **options.named(values))

    return ui_caption  # its name is the private events' API name: never "caption", the API's


def wire_ui(service: CaptionService, page: Page, concurrency: int) -> None:
    """Connect the UI's events: caption on upload, button, example and model change; clear on
    removal and refusal; controls follow the model; words and scale redraw the view."""
    outputs = page.output_list
    run = dict(
        fn=caption_fn(service),
        inputs=[page.image, page.model, page.scale, *page.controls.values()],
        outputs=outputs,
        preprocess=False,
        concurrency_limit=concurrency,
        concurrency_id="caption",
        api_visibility="private",
    )
    quick = dict(queue=False, api_visibility="private")
    # Not image.change: Gradio fires it twice when a new file replaces a shown one (so every
    # toast showed twice), and once more for an example. upload fires once per file.
    gr.on([page.button.click, page.image.upload], trigger_mode="always_last", **run)
    if page.examples is not None:
        page.examples.load_input_event.then(**run)
    # A photo the browser cannot show (HEIC): a converted preview, beside the caption event and
    # not queued behind it (a request outside the queue; decoding is bounded as for captions).
    page.image.upload(
        partial(events.preview_upload, service),
        inputs=[page.image],
        outputs=[page.preview],
        preprocess=False,
        **quick,
    )
    page.image.change(
        events.hide_preview, inputs=[page.image], outputs=[page.preview], preprocess=False, **quick
    )
    # Removing the photo, or Gradio refusing an upload over the size limit, sets it to None:
    # the outputs cleared; the status line says which (the prompt, or the refusal's reason).
    page.image.change(
        events.clear_outputs, inputs=[page.image], outputs=outputs, preprocess=False, **quick
    )
    page.image.clear(events.removed, outputs=outputs, **quick)
    page.refused.click(
        events.refused_upload,
        inputs=[page.outputs["status"]],
        outputs=outputs,
        js="() => [window.__satRefused || '']",
        trigger_mode="always_last",  # a refusal while one is answered: told after it
        **quick,
    )
    # Another model: its defaults in the controls, then the shown photo captioned again.
    page.model.change(
        partial(events.model_controls, service),
        inputs=[page.model],
        outputs=list(page.controls.values()),
        **quick,
    ).then(**run)
    out = page.outputs
    # .input, not .change: only a click. The caption events set the word list and the first
    # word's view themselves; a .change they set off could land after a later event had
    # cleared the outputs (a rejected upload) and bring the old photo's view back.
    out["words"].input(
        events.show_word,
        inputs=[out["state"], out["words"], page.scale],
        outputs=[out["view"], out["note"]],
        **quick,
    )
    page.scale.change(
        events.rescale,
        inputs=[out["state"], out["words"], page.scale],
        outputs=[out["gallery"], out["view"], out["note"]],
        **quick,
    )

    def select_word(state: dict | None, scale: str, evt: gr.SelectData) -> tuple[Any, ...]:
        """A gallery panel clicked: select its word and show it."""
        return (int(evt.index), *events.show_word(state, int(evt.index), scale))

    out["gallery"].select(
        select_word, [out["state"], page.scale], [out["words"], out["view"], out["note"]], **quick
    )


def api_fn(service: CaptionService) -> Callable[..., dict[str, Any]]:
    """The /caption endpoint: (image, model, *the options in table order)."""

    def caption(image: Any, model: str | None, *values: Any) -> dict[str, Any]:
        return api_caption(service, image, model, **options.named(values))

    # Gradio names the API's parameters after the function's: image, model and one per option,
    # so a client passes options by name; Gradio itself passes them positionally.
    plain = inspect.Parameter.POSITIONAL_OR_KEYWORD
    caption.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("image", plain), inspect.Parameter("model", plain, default=None)]
        + [inspect.Parameter(name, plain, default=None) for name in options.option_names()]
    )
    return caption


def wire_api(service: CaptionService, image: gr.Image, concurrency: int) -> None:
    """The /caption API: hidden inputs named after the options, None meaning the chosen
    model's defaults (unlike the UI's controls, which hold the first model's)."""
    names = service.names
    model = gr.Dropdown(names, value=None, label="model", visible=False)
    inputs = options.api_inputs()
    result = gr.JSON(label="result", visible=False)
    button = gr.Button(visible=False)
    button.click(
        api_fn(service),
        inputs=[image, model, *inputs],
        outputs=[result],
        api_name="caption",
        preprocess=False,
        concurrency_limit=concurrency,
        concurrency_id="caption",
        api_description=API_DESCRIPTION,
    )


def build_app(
    service: CaptionService,
    examples: Sequence[Path] = (),
    concurrency: int = 8,
    session_ttl_s: float | None = DEFAULT_SESSION_MINUTES * 60,
) -> gr.Blocks:
    """The UI (upload -> caption, word overlays, beams) and the /caption API endpoint."""
    with ServiceBlocks(title="Show, Attend and Tell") as app:
        page = layout(service, examples, session_ttl_s)
        wire_ui(service, page, concurrency)
        wire_api(service, page.image, concurrency)
    return app


def prepare(
    service: CaptionService,
    max_upload_mb: float = 10.0,
    examples: Sequence[Path] = (),
    concurrency: int = 8,
    queue_size: int = 64,
    cache: CacheBound | None = None,
    session_minutes: float | None = None,
    max_sessions: int = 1000,
) -> gr.Blocks:
    """The app built, with its queue, cache bound and session capacity: what launching and
    mounting it share."""
    service.max_upload_bytes = int(max_upload_mb * 2**20)
    minutes = DEFAULT_SESSION_MINUTES if session_minutes is None else session_minutes
    app = build_app(service, examples, concurrency=concurrency, session_ttl_s=minutes * 60)
    app.max_threads = gradio_threads(concurrency)  # read by queue() and the app's start
    app.queue(max_size=queue_size)
    app.state_session_capacity = max_sessions  # what launch(state_session_capacity=) sets
    # one service may serve several pages (tests, a page with a login beside one without):
    # a photo uploaded to any of them stays readable when another is built
    pages = service.cache.pages
    service.cache = cache or CacheBound(None)
    service.cache.pages.extend(p for p in pages if p not in service.cache.pages)
    service.cache.start(app)
    return app


def mount(
    api: Any,
    service: CaptionService,
    guard: Guard,
    max_upload_mb: float = 10.0,
    auth: Sequence[tuple[str, str]] | None = None,
    **settings: Any,
) -> gr.Blocks:
    """Mount the page (and Gradio's /caption API) at / of the FastAPI app ``api``, as Gradio
    documents (``gr.mount_gradio_app``): one server serves both, behind ``guard``'s middleware
    (in front of ``api``). ``settings``: :func:`prepare`'s."""
    app = prepare(service, max_upload_mb, **settings)
    gr.mount_gradio_app(
        api,
        app,
        path="/",
        footer_links=["api"],
        auth=list(auth) if auth else None,
        max_file_size=int(max_upload_mb * 2**20),
        ssr_mode=False,
        css=CSS,
        js=REFUSAL_JS,
        app_kwargs={"exception_handlers": EXCEPTION_HANDLERS},
    )
    guard.blocks = app
    guard.page_app = api.routes[-1].app  # the Mount just added: Gradio's app, its logins
    return app


def launch(
    service: CaptionService,
    host: str = "127.0.0.1",
    port: int = 7860,
    max_upload_mb: float = 10.0,
    examples: Sequence[Path] = (),
    concurrency: int = 8,
    queue_size: int = 64,
    block: bool = True,
    auth: Sequence[tuple[str, str]] | None = None,
    cache: CacheBound | None = None,
    session_minutes: float | None = None,
    max_sessions: int = 1000,
    guard: Guard | None = None,
    quiet: bool | None = None,
) -> gr.Blocks:
    """Build and start the page alone on Gradio's own server (`sat serve` mounts it beside the
    HTTP API instead: :func:`mount`); ``block=False`` returns once it serves (tests,
    benchmarks), ``block=True`` serves until Ctrl-C. ``quiet``: no address printed (default: not
    block); otherwise one line, as `sat serve` prints it, and none of Gradio's own (its hint to
    set ``share=True``, its Ctrl-C message: lines a user of this service cannot act on).
    ``auth``: (user, password) pairs; the page then needs a login. ``cache``: the bound on
    Gradio's cache folder (None: unbounded). ``session_minutes``: how long a browser session's
    captioned photo is kept (None: the default hour); ``max_sessions``: sessions remembered at
    most (the oldest are forgotten first; every API client is one). ``guard``: the state of the
    middleware in front of the app (login on every route, failed-login throttle, full disk,
    draining on stop).

    Gradio copies the example photos into its cache when the app is built; requests can only
    name files in its upload folder or cache, so no other file on the machine is served or read.
    """
    app = prepare(
        service,
        max_upload_mb,
        examples,
        concurrency,
        queue_size,
        cache,
        session_minutes,
        max_sessions,
    )
    guard = guard or Guard()
    guard.require(auth)
    guard.blocks = app
    app.launch(
        server_name=host,
        server_port=port,
        max_file_size=int(max_upload_mb * 2**20),
        css=CSS,
        js=REFUSAL_JS,
        footer_links=["api"],
        auth=list(auth) if auth else None,
        prevent_thread_lock=True,  # Gradio's own wait prints a line on Ctrl-C: wait() below
        max_threads=app.max_threads,  # launch() sets it again: prepare's, not its default
        quiet=True,  # Gradio's lines name its own launch(): the address is printed here
        state_session_capacity=max_sessions,
        app_kwargs={
            "middleware": [Middleware(GuardMiddleware, guard=guard)],
            "exception_handlers": EXCEPTION_HANDLERS,
        },
    )
    if not (not block if quiet is None else quiet):  # default: quiet unless it blocks
        print(f"{RUNNING_ON}{app.local_url.rstrip('/')}", flush=True)
    if block:
        wait(app)
    return app


def wait(app: gr.Blocks) -> None:
    """Serve until the server ends or Ctrl-C, then close it."""
    try:
        while app.is_running:
            time.sleep(0.2)  # a poll, as Gradio's own block_thread: the server runs in a thread
    except KeyboardInterrupt:
        pass
    finally:
        app.close(verbose=False)
