"""One cell of the architecture sweep: a conformance case on a tiny model of one architecture, greedy decoding of a
left-padded batch against DynamicCache (`modes.run_left_padded`, `compare.assert_conforms`).

A cell is one of:

- ``identical`` (a lossless case: DynamicCache's tokens, logits within 1e-5, `compare.assert_conforms`) or
  ``within tolerance`` (a lossy case: the logits of the prompt and of the first decode step, the one that first reads
  what the cache stored, within the tolerance the case declares in `cases.py`, scaled by the model's logit range
  over the conformance models' (`LOGIT_RANGE`): a tiny random model of another family may have logits several times
  larger, and its later steps amplify any error chaotically, which is what the conformance suite measures);
- ``refused``: building the cache raised a typed hf_kvplus error (`KVPlusError`), whose message names what the cache
  cannot serve;
- ``FAILED``: anything else: another exception, a refusal only once decoding ran, or output outside the promise.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from transformers import DynamicCache

from hf_kvplus.errors import KVPlusError

from .cases import CASES, CacheCase
from .compare import assert_conforms
from .modes import run_left_padded
from .zoo import MODEL_TYPES, Skipped, tiny_model

#: The conformance cases swept over every architecture: each storage, eviction and placement family once.
SWEEP_CASES: tuple[str, ...] = (
    "dense", "paged", "quantized-int8", "quantized-int4", "sink-roomy", "h2o-roomy", "snapkv-roomy", "sink-tight", "h2o-tight",
    "offloaded",
)  # fmt: skip
OUTCOMES = ("identical", "within tolerance", "refused", "FAILED")
#: The largest |logit| of the conformance models' first step (Llama 5.5, Qwen2 6.3): what the declared tolerances
#: were measured against.
LOGIT_RANGE = 6.3
#: Logit steps a lossy cell compares: the prompt's and the first decode step's.
LOSSY_STEPS = 2


@dataclass(frozen=True)
class Cell:
    outcome: str  # one of OUTCOMES
    detail: str = ""


def _case(name: str) -> CacheCase:
    return next(case for case in CASES if case.name == name)


def reference(model_type: str):
    """DynamicCache's run of the left-padded batch on the tiny model (`Skipped` where there is no tiny model, or
    where Transformers' own DynamicCache fails on it)."""
    model = tiny_model(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return run_left_padded(model, lambda model: DynamicCache(config=model.config), None)
        except Exception as error:
            raise Skipped(f"DynamicCache itself fails on the tiny model: {type(error).__name__}: {_line(error)}") from None


def sweep(model_types=MODEL_TYPES, cases=SWEEP_CASES) -> dict[str, dict[str, Cell] | str]:
    """Per model type, its cells by case, or the reason it is skipped."""
    rows: dict[str, dict[str, Cell] | str] = {}
    for model_type in model_types:
        try:
            ref = reference(model_type)
        except Skipped as skipped:
            rows[model_type] = str(skipped)
            continue
        rows[model_type] = {name: cell(model_type, name, ref) for name in cases}
    return rows


def cell(model_type: str, case_name: str, ref) -> Cell:
    """The outcome of conformance case `case_name` on `model_type` against `ref` (its `reference`)."""
    case, model = _case(case_name), tiny_model(model_type)
    try:
        case.make(model)
    except KVPlusError as error:
        return Cell("refused", f"{type(error).__name__}: {_line(error)}")
    except Exception as error:
        return Cell("FAILED", f"at construction, {type(error).__name__}: {_line(error)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = run_left_padded(model, case.make, None)
        if case.lossless:
            assert_conforms(case, ref, got)
        else:
            _within_tolerance(case, ref, got)
    except AssertionError as error:
        return Cell("FAILED", f"outside the promise: {_line(error)}")
    except Exception as error:
        when = "refused only while decoding" if isinstance(error, KVPlusError) else "while decoding"
        return Cell("FAILED", f"{when}, {type(error).__name__}: {_line(error)}")
    return Cell("identical" if case.lossless else "within tolerance")


def _within_tolerance(case: CacheCase, ref, got) -> None:
    assert got.sequences.shape == ref.sequences.shape, f"sequences {tuple(got.sequences.shape)}"
    for step in range(min(LOSSY_STEPS, len(ref.logits))):
        scale = max(1.0, ref.logits[step].abs().max().item() / LOGIT_RANGE)
        diff = (got.logits[step] - ref.logits[step]).abs().max().item()
        bound = case.logits_atol * scale
        assert diff <= bound, f"[{case.name}] step {step}: max |logits diff| {diff:.3g} > {bound:.3g}"


def _line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0][:240]
