"""Which device the model runs on: `--device auto|cpu|cuda`, resolved once, named in plain words.

The core creates every tensor on the backbone's device (`Backbone.device`); timings on CUDA wait for
the device first (`Backbone.sync`), because CUDA kernels run asynchronously.
"""
from __future__ import annotations

import argparse

import torch

DEVICES = ("auto", "cpu", "cuda")
DEFAULT_DEVICE = "auto"


def resolve_device(name: str | torch.device | None = DEFAULT_DEVICE) -> torch.device:
    """"auto" → CUDA when available, else the CPU; "cpu"; "cuda" (or "cuda:N") only where CUDA is."""
    if isinstance(name, torch.device):
        name = str(name)
    name = (name or DEFAULT_DEVICE).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine (torch "
                             f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                             "use --device cpu or --device auto")
        try:
            device = torch.device(name)
        except RuntimeError as exc:
            raise ValueError(f"--device {name}: {exc}") from exc
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return device
    raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")


def device_label(device: str | torch.device) -> str:
    """The device in words, as the latency model and the app record it: "cpu (2 threads)",
    "cuda: NVIDIA H100 80GB HBM3"."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        n = torch.get_num_threads()
        return f"cpu ({n} thread{'' if n == 1 else 's'})"
    return device.type


def same_device(label_a: str | None, label_b: str | None) -> bool:
    """Whether two device labels name the same kind of device (thread counts aside)."""
    def kind(label):
        return (label or "cpu").split(" (")[0].strip()
    return kind(label_a) == kind(label_b)


def _device_arg(text: str) -> torch.device:
    try:
        return resolve_device(text)
    except ValueError as exc:           # argparse says "argument --device:" itself
        message = str(exc).removeprefix(f"--device {text.strip().lower()}: ")
        raise argparse.ArgumentTypeError(message) from exc


def add_device_argument(ap: argparse.ArgumentParser) -> None:
    """`--device auto|cpu|cuda` (default auto); the parsed value is a torch.device, checked at parse time."""
    ap.add_argument("--device", default=DEFAULT_DEVICE, type=_device_arg, metavar="{auto,cpu,cuda}",
                    help="where the model runs: auto (CUDA when available, else the CPU), cpu or cuda")
