"""The decoding options in the web UI and the API, made from decoding.py's one table.

``showattendtell.search.options.DECODING_OPTIONS`` declares every ``DecodingConfig`` field once
(its range, label, help and control); here each becomes a UI control, a hidden input of the
``/caption`` API and a control update when another model is chosen. Nothing here names an
option, so a new option needs no change in the service.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import gradio as gr

from showattendtell.captioning.captioner import Captioner
from showattendtell.search.decoding import DECODING_OPTIONS, DecodingConfig, DecodingOption


def elem_id(opt: DecodingOption) -> str:
    """The control's HTML id: the flag without its dashes (beam-size)."""
    return opt.flag[2:]


def control(opt: DecodingOption, value: Any, visible: bool = True) -> gr.Component:
    """The UI control of one option, set to ``value`` and limited to the option's range."""
    label = opt.ui_label or opt.label.capitalize()
    info = opt.ui_info or None
    if opt.widget == "radio":
        choices = (
            list(zip(opt.ui_choices, opt.choices, strict=True))
            if opt.ui_choices
            else list(opt.choices)
        )
        return gr.Radio(
            choices, value=value, label=label, info=info, visible=visible, elem_id=elem_id(opt)
        )
    if opt.widget == "number":
        return gr.Number(
            value,
            precision=0 if opt.kind == "int" else None,
            minimum=opt.low,
            maximum=opt.high,
            label=label,
            info=info,
            visible=visible,
            elem_id=elem_id(opt),
        )
    return gr.Slider(
        opt.low,
        opt.high,
        value=value,
        step=opt.step,
        label=label,
        info=info,
        visible=visible,
        elem_id=elem_id(opt),
    )


def controls(captioner: Captioner) -> dict[str, gr.Component]:
    """Every option's control, set to the model's defaults (hidden where the option does not
    apply to it): the main ones here, the advanced ones in a closed accordion. Call inside a
    ``gr.Blocks`` layout."""
    made: dict[str, gr.Component] = {}
    d = captioner.decoding

    def add(options: Iterable[DecodingOption]) -> None:
        for opt in options:
            made[opt.name] = control(opt, getattr(d, opt.name), captioner.applies(opt))

    add(o for o in DECODING_OPTIONS.values() if not o.advanced)
    with gr.Accordion("More decoding options", open=False):
        add(o for o in DECODING_OPTIONS.values() if o.advanced)
    return {name: made[name] for name in DECODING_OPTIONS}  # the table's order


def api_inputs() -> list[gr.Component]:
    """The hidden inputs of the /caption API, one per option, named by its field: None (left
    out) is the chosen model's default."""
    inputs: list[gr.Component] = []
    for opt in DECODING_OPTIONS.values():
        if opt.choices:
            inputs.append(gr.Dropdown(list(opt.choices), value=None, label=opt.name, visible=False))
        else:
            inputs.append(gr.Number(None, label=opt.name, visible=False))
    return inputs


def control_updates(captioner: Captioner) -> tuple[Any, ...]:
    """The controls set to another model's defaults, shown only where they apply to it."""
    d = captioner.decoding
    return tuple(
        gr.update(value=getattr(d, opt.name), visible=captioner.applies(opt))
        for opt in DECODING_OPTIONS.values()
    )


def option_names() -> list[str]:
    """The options in the table's order: the order of the controls, inputs and values."""
    return list(DECODING_OPTIONS)


def named(values: Iterable[Any]) -> dict[str, Any]:
    """Values in the table's order (as the UI and API send them) by option name."""
    values = list(values)
    if len(values) != len(DECODING_OPTIONS):
        raise ValueError(f"expected {len(DECODING_OPTIONS)} decoding values, got {len(values)}")
    return dict(zip(DECODING_OPTIONS, values, strict=True))


def applicable(captioner: Captioner, values: Mapping[str, Any]) -> dict[str, Any]:
    """The UI's values without those of options that do not apply to the model (a hidden
    control still holds the first model's value): those stay the model's own."""
    return {
        name: value
        for name, value in values.items()
        if name in DECODING_OPTIONS and captioner.applies(DECODING_OPTIONS[name])
    }


def reported(captioner: Captioner, config: DecodingConfig) -> dict[str, Any]:
    """The settings that made a caption, as the API reports them: only the options that apply
    to the model (no hard-attention mode for a soft-attention model)."""
    return {
        name: value
        for name, value in config.to_dict().items()
        if captioner.applies(DECODING_OPTIONS[name])
    }
