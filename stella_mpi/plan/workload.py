"""What the planner trains: a user's script with an entry point, or a named size.

A script's entry point (``PATH[:FUNCTION]``, default ``stella_plan``) is called on every rank of
the calibration as ``stella_plan(batch_size, rank, **model_args)`` and returns a dict:

=================  ==========================================================================
``model``          the ``torch.nn.Module`` (required)
``next_batch``     ``() -> (inputs, targets)``, this rank's next batch of ``batch_size`` samples
                   (required)
``loss``           ``(output, targets) -> scalar tensor`` (default: cross-entropy)
``optimizer``      ``(params) -> torch.optim.Optimizer`` (default: SGD, lr 0.05, momentum 0.9)
``evaluate``       ``(model) -> float``, the held-out loss (needed for a target loss)
``global_batch``   samples per step over all ranks when ``--global-batch`` is not given
``tokens_per_sample``  for a language model: tokens in one sample (information only)
=================  ==========================================================================

``examples/plan_model.py`` is a complete one. A named size (:data:`SIZES`) is a decoder-only
transformer given by its shapes: its parameters are listed (nothing is allocated), its compute
comes from the GPU table (6 x parameters x tokens per sample), and its quality cannot be
measured here, so time to a target needs ``--target-steps``.
"""
import importlib.util
import os
import traceback
from dataclasses import dataclass
from typing import Callable, Optional


class ModelScriptError(RuntimeError):
    """The model script failed; the message names it and holds its own error."""


@dataclass(frozen=True)
class TransformerSize:
    """A decoder-only transformer (Llama-style: untied embeddings, gated MLP, RMSNorm)."""
    d_model: int
    layers: int
    ffn: int
    vocab: int
    kv_dim: int
    tokens_per_sample: int

    def param_numels(self):
        """Every parameter's number of elements, in registration order (embedding first)."""
        d, f, kv = self.d_model, self.ffn, self.kv_dim
        layer = [d, d * d, d * kv, d * kv, d * d, d, d * f, d * f, f * d]   # norm, q k v o, norm, gate up down
        return [self.vocab * d] + layer * self.layers + [d, self.vocab * d]


# GPT-2 small's shapes with a Llama block; Llama 3.2 1B; Llama 2 7B; Llama 2 70B (grouped KV)
SIZES = {
    "100m": TransformerSize(d_model=768, layers=12, ffn=2048, vocab=32000, kv_dim=768, tokens_per_sample=1024),
    "1b": TransformerSize(d_model=2048, layers=16, ffn=8192, vocab=128256, kv_dim=512, tokens_per_sample=2048),
    "7b": TransformerSize(d_model=4096, layers=32, ffn=11008, vocab=32000, kv_dim=4096, tokens_per_sample=4096),
    "70b": TransformerSize(d_model=8192, layers=80, ffn=28672, vocab=32000, kv_dim=1024, tokens_per_sample=4096),
}


@dataclass
class Workload:
    """One rank's model and data for the calibration."""
    model: object
    next_batch: Callable
    loss: Callable
    make_optimizer: Callable
    evaluate: Optional[Callable]
    global_batch: Optional[int]
    tokens_per_sample: Optional[int]


def split_source(source):
    """'path/to/x.py:fn' -> (path, fn); a named size -> (None, None)."""
    if str(source).lower() in SIZES:
        return None, None
    path, sep, fn = str(source).rpartition(":")
    if not sep or not path.endswith(".py"):
        path, fn = str(source), "stella_plan"
    return path, fn


def check_source(source):
    """A clear error for a model that is neither a named size nor an existing script."""
    path, _ = split_source(source)
    if path is None:
        return
    if not path.endswith(".py"):
        raise ValueError("--model %r: neither a named size (%s) nor a Python script (PATH.py[:FUNCTION])"
                         % (source, ", ".join(SIZES)))
    if not os.path.isfile(path):
        raise ValueError("--model %r: no such script" % path)


def load(source, batch_size, rank, model_args=None):
    """Call the script's entry point; any failure becomes a ModelScriptError naming the script
    with its own traceback."""
    path, fn = split_source(source)
    check_source(source)
    try:
        spec = importlib.util.spec_from_file_location("stella_plan_model", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:
        raise ModelScriptError("model script %s failed while loading:\n%s" % (path, traceback.format_exc())) from None
    entry = getattr(module, fn, None)
    if not callable(entry):
        raise ModelScriptError("model script %s has no function %s(batch_size, rank, **args) (see "
                               "examples/plan_model.py for the contract)" % (path, fn))
    try:
        got = entry(batch_size, rank, **(model_args or {}))
    except Exception:
        raise ModelScriptError("model script %s: %s(batch_size=%d, rank=%d) failed:\n%s"
                               % (path, fn, batch_size, rank, traceback.format_exc())) from None
    missing = [k for k in ("model", "next_batch") if k not in (got or {})]
    if missing:
        raise ModelScriptError("model script %s: %s() returned no %s (it returns a dict; see examples/plan_model.py)"
                               % (path, fn, " and no ".join(missing)))
    import torch
    return Workload(model=got["model"], next_batch=got["next_batch"],
                    loss=got.get("loss") or torch.nn.functional.cross_entropy,
                    make_optimizer=got.get("optimizer") or (lambda params: torch.optim.SGD(params, lr=0.05,
                                                                                           momentum=0.9)),
                    evaluate=got.get("evaluate"), global_batch=got.get("global_batch"),
                    tokens_per_sample=got.get("tokens_per_sample"))
