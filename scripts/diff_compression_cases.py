"""The compression branch of the differential test (scripts/diff_compression.py): its grammar,
its seeded generator, and how a pair of results (DeepSpeed 0.17.6's, ours) is classified.
Pure logic: no torch, no processes.

A case is one training script through `init_compression`, `deepspeed.initialize`, STEPS
steps and `redundancy_clean`, on a small model (an MLP `fc1`/`fc2`/`fc3`, or a CNN
`conv1`/`bn1`/`conv2`/`fc`), at ZeRO 0 or 2, with one to three compression techniques, each
with its method, schedule offset (0-3), ratio or bits, and with or without its
`related_modules`. DeepSpeed 0.17.6 is the reference: the last release that shipped
`deepspeed.compression` (0.19.8, the project's specification elsewhere, no longer has it).

Its one-line form (`CompCase.line`, scripts/case_line.py) names every field that differs from
the default, as `key=value`; `CompCase.parse` reads it back, so a case nobody drew is one
line in EXTRA_CASES.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from case_line import CaseLine, draw_distinct
from diff_cases import Tolerance, Verdict, _pick, _short, close, tensors_apart

SEED = 20176
COUNT = 110  # cases drawn from SEED; EXTRA_CASES are added to them
STEPS = 6    # optimizer steps per case: every offset 0-3 starts inside the run

MODELS = {
    "mlp": "Linear 8-16 fc1, 16-16 fc2, 16-4 fc3 (ReLU between); row pruning of fc2 (related fc3), head "
           "pruning of fc2's inputs in 4 heads (related fc1)",
    "cnn": "Conv2d 3-8 conv1, BatchNorm2d bn1, Conv2d 8-6 conv2, Linear 6-4 fc; channel pruning of conv1 "
           "(related bn1 and conv2)",
    "stack": "Linear 8-16 emb, a ModuleList `layers` of residual Linear 16-16 + ReLU, Linear 16-4 head; layer "
             "reduction from a 4-layer teacher (other seed) to keep_number_layer 2, emb and head copied",
}
# which techniques a model offers (the grammar draws from these)
TECHNIQUES = {"mlp": ("sparse", "row", "head", "wq", "aq"), "cnn": ("sparse", "channel", "wq", "aq"),
              "stack": ("reduce", "sparse", "wq", "aq")}
TEACHER_LAYERS = ("0,2", "1,3", "2,3", "3,0")
PRUNE_METHODS = ("none", "l1", "topk")
QUANT_TYPES = ("none", "sym", "asym")


@dataclass(frozen=True)
class CompCase(CaseLine):
    model: str = "mlp"
    stage: int = 0                 # ZeRO stage (0 or 2; ZeRO-3 is refused by both)
    clip: float = 0.0              # gradient_clipping, always given: its default is 0 in DeepSpeed 0.17.6,
                                   # 1.0 in 0.19.8 (the project's specification, and ours)
    sparse: str = "none"           # sparse_pruning method: none | l1 | topk
    sparse_at: int = 0             # its schedule_offset
    sparse_ratio: float = 0.5      # its dense_ratio
    sparse_all: bool = False       # every layer of the model ("fc" / "conv"), else the first one
    row: str = "none"              # row_pruning (mlp: fc2)
    row_at: int = 0
    row_ratio: float = 0.5
    row_rel: bool = False          # related_modules [["fc3"]]
    head: str = "none"             # head_pruning (mlp: fc2's input columns, 4 heads): topk (l1: DeepSpeed raises)
    head_at: int = 0
    head_ratio: float = 0.5
    head_rel: bool = False         # related_modules [["fc1"]]
    channel: str = "none"          # channel_pruning (cnn: conv1)
    channel_at: int = 0
    channel_ratio: float = 0.5
    channel_rel: bool = False      # related_modules [["bn1", "conv2"]]
    wq: str = "none"               # weight_quantization: none | sym | asym, on every layer
    wq_at: int = 0
    wq_bits: int = 8               # target_bits
    wq_start: int = 0              # start_bits (0: target_bits)
    wq_groups: int = 1             # quantize_groups
    wq_conv: bool = False          # cnn: the Conv2d layers too (DeepSpeed 0.17.6 raises on them), else fc only
    aq: str = "none"               # activation_quantization: none | sym | asym, on the last two layers
    aq_at: int = 0
    aq_bits: int = 8
    aq_static: bool = False        # range_calibration static (else dynamic)
    reduce: str = "none"           # layer_reduction (stack): teacher_layer, e.g. "1,3" (keep_number_layer 2)
    student: int = 2               # the student's depth before init_compression (stack)

    def techniques(self) -> List[str]:
        """The techniques the case enables, by this grammar's short names."""
        out = [t for t in ("reduce", "sparse", "row", "head", "channel") if getattr(self, t) != "none"]
        return out + [t for t in ("wq", "aq") if getattr(self, t) != "none"]

    def problem(self) -> Optional[str]:
        """Why the fields cannot describe a run (not: why an engine would refuse it)."""
        if self.model not in MODELS:
            return f"model {self.model!r} is not one of {sorted(MODELS)}"
        for t in ("sparse", "row", "head", "channel"):
            if getattr(self, t) not in PRUNE_METHODS:
                return f"{t} must be one of {PRUNE_METHODS}"
        for t in ("wq", "aq"):
            if getattr(self, t) not in QUANT_TYPES:
                return f"{t} must be one of {QUANT_TYPES}"
        wrong = [t for t in self.techniques() if t not in TECHNIQUES[self.model]]
        if wrong:
            return f"model {self.model} has no target for {wrong}"
        if not self.techniques():
            return "at least one technique"
        if self.reduce != "none" and self.reduce not in TEACHER_LAYERS:
            return f"reduce must be one of {TEACHER_LAYERS}"
        if self.student not in (2, 4) or (self.student != 2 and self.model != "stack"):
            return "student (2 or 4) is the stack's depth"
        if self.model == "stack" and self.reduce == "none":
            return "the stack model is for layer reduction"
        if self.wq_conv and (self.model != "cnn" or self.wq == "none"):
            return "wq_conv needs model cnn and wq"
        if self.stage not in (0, 1, 2, 3):
            return "stage must be 0-3"
        return None


# -- the generator -------------------------------------------------------------------------------
def draw(rng: random.Random) -> CompCase:
    """One case: a model, a ZeRO stage, and 1-3 of the model's techniques with their settings."""
    model = _pick(rng, {"mlp": 3, "cnn": 2, "stack": 0.8})
    stage = _pick(rng, {0: 1, 2: 1})
    clip = _pick(rng, {0.0: 3, 1.0: 1})
    n = _pick(rng, {1: 3, 2: 3, 3: 1.5})
    chosen = rng.sample(TECHNIQUES[model], n)
    if model == "stack" and "reduce" not in chosen:
        chosen[0] = "reduce"
    kw: Dict[str, object] = {"model": model, "stage": stage, "clip": clip}
    for t in chosen:
        offset = rng.randint(0, 3)
        if t == "reduce":
            kw["reduce"] = rng.choice(TEACHER_LAYERS)
        elif t in ("sparse", "row", "channel"):
            # channel pruning by l1 raises in DeepSpeed 0.17.6: drawn less, so that more cases compare
            kw[t] = _pick(rng, {"l1": 1, "topk": 3} if t == "channel" else {"l1": 1, "topk": 1})
            kw[f"{t}_at"] = offset
            kw[f"{t}_ratio"] = _pick(rng, {0.25: 1, 0.5: 2, 0.75: 1})
            if t == "sparse":
                kw["sparse_all"] = rng.random() < 0.4
            else:
                kw[f"{t}_rel"] = rng.random() < 0.6
        elif t == "head":
            kw["head"] = _pick(rng, {"topk": 6, "l1": 1})  # l1: DeepSpeed raises; both should refuse
            kw["head_at"] = offset
            kw["head_ratio"] = _pick(rng, {0.25: 1, 0.5: 2, 0.75: 1})
            kw["head_rel"] = rng.random() < 0.6
        elif t == "wq":
            kw["wq"] = _pick(rng, {"sym": 1, "asym": 1})
            kw["wq_at"] = offset
            kw["wq_bits"] = _pick(rng, {8: 1, 4: 1})
            if kw["wq_bits"] == 4 and rng.random() < 0.2:
                kw["wq_start"] = 8  # a falling bit width: DeepSpeed's fake-quant reads target_bits only
            kw["wq_groups"] = rng.choice((1, 2) if model == "cnn" else (1, 2, 4))
            kw["wq_conv"] = model == "cnn" and rng.random() < 0.15
        else:
            kw["aq"] = _pick(rng, {"sym": 1, "asym": 1})
            kw["aq_at"] = offset
            kw["aq_bits"] = _pick(rng, {8: 1, 4: 1})
            kw["aq_static"] = rng.random() < 0.5
    case = CompCase(**kw)
    assert case.problem() is None, (case, case.problem())
    return case


# Cases nobody drew, one line each: paths worth keeping whatever the seed draws.
EXTRA_CASES: List[str] = [
    # the case: row pruning l1 of fc2 from step 2 with fc3 related, at ZeRO 0 and 2
    "model=mlp row=l1 row_at=2 row_rel=1",
    "model=mlp stage=2 row=l1 row_at=2 row_rel=1",
    # row, sparse and head pruning on the same layers
    "model=mlp sparse=l1 sparse_at=1 row=l1 row_at=2 row_rel=1 head=topk head_at=3 head_rel=1",
    "model=mlp stage=2 sparse=topk sparse_at=1 row=topk row_at=2 row_rel=1 head=topk head_at=3 head_rel=1",
    # every technique of the CNN at once
    "model=cnn sparse=l1 sparse_at=1 channel=topk channel_at=2 channel_rel=1 wq=sym wq_at=1 aq=asym aq_at=3 "
    "aq_static=1",
    # a student deeper than keep_number_layer
    "model=stack reduce=1,3 student=4",
    # what DeepSpeed 0.17.6 cannot run: channel pruning by l1; ZeRO-3
    "model=cnn channel=l1 channel_at=1 channel_rel=1",
    "model=mlp stage=3 row=l1 row_rel=1",
]


def generate(seed: int = SEED, count: int = COUNT) -> List[CompCase]:
    """COUNT distinct cases drawn from SEED, then EXTRA_CASES (duplicates dropped)."""
    return draw_distinct(draw, CompCase, EXTRA_CASES, seed, count)


# -- comparing -------------------------------------------------------------------------------------
# Every case computes in fp32 (DeepSpeed 0.17.6's compression layers run fp32 weights only here).
TOLERANCES = {
    "fp32": Tolerance(1e-5, 1e-5, "the same fp32 arithmetic on the same machine and torch, in another order where "
                                  "the engines differ (ZeRO-2's flat gradient buffer, a parametrized weight "
                                  "against a layer's own forward): a few ulp per step, which 6 Adam steps "
                                  "(division by sqrt(v)) grow to about 1e-6; 1e-5 leaves a margin of ten"),
}

CLASSES = ("equal", "refused by both", "refused here only (listed)", "refused by DeepSpeed only",
           "different by design (listed)", "open divergence (listed)", "divergence")

# Our refusals where DeepSpeed 0.17.6 trains: a gap each, the text our one-line error contains
# -> why. A refusal of ours not listed here is a divergence.
GAPS: Dict[str, str] = {
    "compression_training: works with ZeRO stages 0-2":
        "ZeRO-3: our masks and fake-quant are parametrizations computed on the whole weight, which ZeRO-3 "
        "partitions; DeepSpeed 0.17.6 trains it (on one rank the same numbers as its ZeRO-0: its l1 masks are "
        "taken at init_compression, before the partition, and its layers see gathered weights in forward); "
        "here refused in one line (use stage 2)",
}

# Where DeepSpeed 0.17.6 trains and we train other numbers on purpose: applies(case) -> why.
# Classified apart from a divergence only while the case does differ.
DESIGN: List[Tuple[str, object, str]] = [
    ("falling bits", lambda c: c.wq != "none" and c.wq_start not in (0, c.wq_bits),
     "DeepSpeed 0.17.6's fake-quant path reads target_bits only (start_bits and quantization_period feed its "
     "in-place MoQ quantizer, which quantize_weight_in_forward bypasses); here the bits fall from start_bits "
     "to target_bits, one every quantization_period steps, as the config describes"),
    ("deeper student", lambda c: c.reduce != "none" and c.student > 2,
     "DeepSpeed 0.17.6 copies the teacher's layers into the student's first ones and leaves the rest: it reads "
     "keep_number_layer nowhere, so a student deeper than keep_number_layer trains all its layers; here the "
     "stack is cut to keep_number_layer layers, as the key says (DeepSpeed's examples build the student with "
     "that depth, where both agree)"),
]

# Divergences found and not resolved, by case line, with what is known. The test fails on any
# other divergence, and on a listed one that no longer diverges.
OPEN: Dict[str, str] = {}


MEASURED = " | measured: "  # between a listed reason and what the case measured


def design_reason(case: CompCase) -> Optional[str]:
    reasons = [why for _, applies, why in DESIGN if applies(case)]
    return "; ".join(reasons) if reasons else None


def gap_reason(message: str) -> Optional[str]:
    for text, why in GAPS.items():
        if text in message:
            return why
    return None


def classify(case: CompCase, ds: dict, ours: dict) -> Verdict:
    """`ds`, `ours`: a run's result ({"losses", "weights": {name: values}, "shapes"} or
    {"error": line, "lines": n})."""
    if "error" in ours:
        if ours.get("lines", 1) != 1:
            return Verdict("divergence", f"our refusal is not one line: {ours['error']}")
        if "error" in ds:
            return Verdict("refused by both", f"DeepSpeed: {ds['error']} | here: {ours['error']}")
        why = gap_reason(ours["error"])
        if why:
            return Verdict("refused here only (listed)", f"{ours['error']} ({why})")
        return Verdict("divergence", f"DeepSpeed trains it; here: {ours['error']} (not a listed gap)")
    if "error" in ds:
        return Verdict("refused by DeepSpeed only", ds["error"])
    problems = compare_runs(ds, ours, case.model)
    if not problems:
        return Verdict("equal")
    why = design_reason(case)
    if why:
        return Verdict("different by design (listed)", f"{why}{MEASURED}{'; '.join(problems)}")
    if case.line in OPEN:
        return Verdict("open divergence (listed)", f"{OPEN[case.line]}{MEASURED}{'; '.join(problems)}")
    return Verdict("divergence", "; ".join(problems))


# Parameters whose final values are not compared (which of them are zero still is), per model,
# with the reason: their true gradient is zero, so what they receive is rounding noise, which
# Adam's normalised step turns into full-size steps.
NOISE_PARAMS: Dict[str, Dict[str, str]] = {
    "cnn": {"conv1.bias": "batch norm bn1 subtracts the batch mean right after conv1"},
}


def compare_runs(ds: dict, ours: dict, model: str = "mlp") -> List[str]:
    tol = TOLERANCES["fp32"]
    problems = []
    ok, worst = close(ours["losses"], ds["losses"], tol)
    if not ok:
        problems.append(f"losses differ (worst {worst:.3g}x the tolerance): DeepSpeed {_short(ds['losses'])}, "
                        f"here {_short(ours['losses'])}")
    if ours["shapes"] != ds["shapes"]:
        apart = sorted(k for k in set(ds["shapes"]) | set(ours["shapes"])
                       if ds["shapes"].get(k) != ours["shapes"].get(k))
        problems.append("cleaned shapes differ: " + ", ".join(
            f"{k} DeepSpeed {ds['shapes'].get(k)} here {ours['shapes'].get(k)}" for k in apart))
    else:
        names = sorted(n for n in ds["weights"] if n not in NOISE_PARAMS.get(model, {}))
        bad = tensors_apart([v for n in names for v in ours["weights"][n]], [v for n in names for v in ds["weights"][n]],
                            [len(ds["weights"][n]) for n in names], names, tol)
        if bad:
            problems.append("cleaned weights differ: " + ", ".join(f"{n} ({r:.3g}x the tolerance)" for n, r in bad))
        zeros = [n for n in sorted(ds["weights"]) if [v == 0 for v in ours["weights"][n]] != [v == 0 for v in ds["weights"][n]]]
        if zeros:
            problems.append("other weights pruned (zeros) in: " + ", ".join(zeros))
    return problems
