"""KNN-SSD Studio — minimal app: streams autoregressive text from the embedded model."""
from __future__ import annotations

import argparse

import gradio as gr

from ssd_core.backbone import load_backbone
from ssd_core.decode import DecodeConfig
from ssd_core.generate import stream_text


def build(backbone):
    def run(prompt: str, max_new_tokens: int):
        if not prompt or not prompt.strip():
            yield "Please type a prompt."
            return
        text = ""
        for delta in stream_text(backbone, prompt, None, DecodeConfig(max_new_tokens=int(max_new_tokens))):
            text += delta
            yield text

    with gr.Blocks(title="KNN-SSD Studio") as demo:
        gr.Markdown(f"# KNN-SSD Studio\nmodel: {backbone.name} · {backbone.n_layers} layers")
        prompt = gr.Textbox(label="Prompt", lines=3)
        n = gr.Slider(8, 512, value=128, step=8, label="max new tokens")
        out = gr.Textbox(label="Output", lines=10)
        gr.Button("Generate", variant="primary").click(run, [prompt, n], out)
    return demo


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    build(load_backbone(args.model, threads=2)).queue(default_concurrency_limit=2).launch()


if __name__ == "__main__":
    main()
