"""The grammar of scripts/diff_vs_deepspeed.py's cases, its seeded generator, and how a
pair of results (DeepSpeed's, ours) is classified. Pure logic: no torch, no processes.

A case is one training script drawn from the grammar: a model, a world size, a config
(ZeRO stage, offloads, dtype and loss scaling, optimizer, scheduler, clipping, gradient
reduction settings) and a loop (engine.backward or PyTorch-style backward, accumulation,
no_sync, zero_grad placement, evaluation between steps, a save and a resume, possibly at
another world size). Its one-line form (`Case.line`) names every field that differs from
the default, `key=value` separated by spaces (scripts/case_line.py); that line is the case's
name in the fixtures, and `Case.parse` reads it back, so a case nobody drew is one more line
in EXTRA_CASES.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from case_line import CaseLine, draw_distinct

SEED = 20250
COUNT = 560  # cases drawn from SEED; EXTRA_CASES are added to them

# name: what the model exercises (scripts/diff_runner.py builds them)
MODELS = {
    "mlp": "two linear layers",
    "gpt": "a tiny GPT (embeddings, attention, layer norm, MLP)",
    "tied": "a language model whose output layer is its embedding (one parameter, two uses)",
    "frozen": "an MLP whose first layer does not train (requires_grad False)",
    "unused": "an MLP with a layer forward never calls (no gradient ever)",
    "buffers": "an MLP with batch norm (running statistics) and a constant buffer",
    "shared": "one linear layer's weight assigned to a second module",
    "hf": "a Hugging Face Llama with tied embeddings and grouped-query attention, built from a config "
          "(transformers as pinned)",
    "moe": "dense, DeepSpeed's MoE layer (4 experts, expert parallel over ep ranks), dense",
    "tp": "a Hugging Face Llama sharded by AutoTP (tensor_parallel.autotp_size)",
}
OPTIMIZERS = ("adam", "adamw", "adam_l2", "torch_adamw", "adagrad", "sgd", "rmsprop", "lion", "lamb",
              "client_adamw", "client_sgd")
SCHEDULERS = ("none", "warmup", "decay", "cosine", "onecycle", "client")
DTYPES = ("fp32", "bf16", "fp16")
REDUCE_DTYPES = ("none", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Case(CaseLine):
    model: str = "mlp"
    world: int = 1
    ep: int = 1            # expert-parallel size (model moe)
    tp: int = 1            # tensor-parallel size (model tp)
    stage: int = 0
    offload: str = "none"  # none | opt | opt+param
    dtype: str = "fp32"
    loss_scale: int = 0    # fp16: 0 dynamic, else static
    scale_power: int = 8   # fp16: initial_scale_power of the dynamic scale
    scale_window: int = 2  # fp16: loss_scale_window (steps without overflow before the scale doubles)
    opt: str = "adam"
    sched: str = "none"
    clip: float = 0.0
    prescale: bool = False
    predivide: float = 1.0
    comm: str = "none"     # communication_data_type
    gad: str = "none"      # data_types.grad_accum_dtype
    batch: bool = False    # give train_batch_size too
    micro: int = 2
    accum: int = 1
    steps: int = 3
    backward: str = "engine"  # engine | torch (loss.backward()) | scale (engine.scale(loss).backward())
    zero_grad: str = "none"   # none | boundary (after each optimizer step) | micro (before every forward)
    no_sync: bool = False     # every micro-step but the last of a window inside engine.no_sync()
    eval: bool = False        # an evaluation forward after the first step
    save: int = 0             # save after this step (0: never), then resume in a fresh engine ...
    resume_world: int = 0     # ... on this many ranks (0: the same world)
    universal: bool = False   # ... from the saved checkpoint converted by the engine's ds_to_universal
                              # (checkpoint.load_universal), DeepSpeed's way to change the world size
    allow_untested: bool = False  # zero_allow_untested_optimizer (EQUIVALENTS set it where they move to ZeRO)

    def problem(self) -> Optional[str]:
        """Why the fields cannot describe a run (not: why an engine would refuse it)."""
        if self.model not in MODELS:
            return f"model {self.model!r} is not one of {sorted(MODELS)}"
        if self.opt not in OPTIMIZERS or self.sched not in SCHEDULERS or self.dtype not in DTYPES:
            return "unknown optimizer, scheduler or dtype"
        if self.comm not in REDUCE_DTYPES or self.gad not in REDUCE_DTYPES:
            return "unknown communication or accumulation dtype"
        if not 1 <= self.world <= 4 or self.world % (self.ep * self.tp):
            return "world must be 1-4 and a multiple of ep x tp"
        if self.save and not 0 < self.save < self.steps:
            return "save must fall before the last step"
        if (self.resume_world or self.universal) and not self.save:
            return "resume_world and universal need save"
        return None

    # -- derived -----------------------------------------------------------------------------
    @property
    def phases(self) -> List[int]:
        """The world size of each process group the case runs in, in order."""
        if self.save and self.resume_world and self.resume_world != self.world:
            return [self.world, self.resume_world]
        return [self.world]

    @property
    def layout(self) -> Tuple[str, int]:
        """Cases of one layout share worker processes (DeepSpeed keeps tensor-parallel
        groups for the life of a process)."""
        return ("tp", self.tp) if self.tp > 1 else ("dp", 1)


# -- the generator -------------------------------------------------------------------------
def _pick(rng: random.Random, weighted: Dict[object, float]):
    items = list(weighted.items())
    return rng.choices([k for k, _ in items], weights=[w for _, w in items])[0]


def draw(rng: random.Random) -> Case:
    """One case. Mostly runs both engines should train; some draws are combinations an
    engine refuses (offload at stage 0, no_sync at stage 2-3, PyTorch-style fp16 without
    engine.scale), so the refusals are compared too."""
    model = _pick(rng, {"mlp": 4, "gpt": 2, "tied": 1.5, "frozen": 1.5, "unused": 1.5, "buffers": 1.5,
                        "shared": 1.5, "hf": 1, "moe": 1, "tp": 0.6})
    world = _pick(rng, {1: 2, 2: 3, 3: 1, 4: 1.5})
    ep = tp = 1
    if model == "moe":
        ep = rng.choice([e for e in (1, 2, 4) if world % e == 0])
    if model == "tp":
        world = rng.choice([2, 4])
        tp = 2
    stage = _pick(rng, {0: 1, 1: 1, 2: 1.2, 3: 1.2})
    offload = "none"
    r = rng.random()
    if stage > 0 or r < 0.02:  # stage 0 rarely: an offload there is refused
        if r < 0.22:
            offload = "opt"
        elif r < 0.32 and (stage == 3 or r < 0.24):  # parameters offload at stage 3 only
            offload = "opt+param"
    dtype = _pick(rng, {"fp32": 2, "bf16": 1.3, "fp16": 1})
    loss_scale, scale_power = 0, 8
    if dtype == "fp16":
        loss_scale = _pick(rng, {0: 3, 128: 1})
        scale_power = _pick(rng, {8: 3, 16: 1})  # 2**16: the first steps overflow and are skipped
    if offload == "none":  # DeepSpeed's CPU accelerator has no Lion or Lamb kernel but its CPU-offload Lion
        opt = _pick(rng, {"adam": 3, "adamw": 1, "adam_l2": 0.5, "torch_adamw": 1.5, "adagrad": 1, "sgd": 1,
                          "rmsprop": 0.5, "client_adamw": 1, "client_sgd": 0.7})
    else:
        opt = _pick(rng, {"adam": 3, "adamw": 1, "torch_adamw": 1, "adagrad": 1, "lion": 1, "sgd": 0.3,
                          "client_adamw": 0.5})
    sched = _pick(rng, {"none": 6, "warmup": 1, "decay": 1, "cosine": 0.7, "onecycle": 0.5, "client": 0.7})
    clip = _pick(rng, {0.0: 3, 1.0: 1, 0.05: 1.5})
    prescale = rng.random() < 0.15
    predivide = 2.0 if rng.random() < 0.15 else 1.0
    comm = _pick(rng, {"none": 5, "fp32": 1, "bf16": 0.5, "fp16": 0.3})
    gad = _pick(rng, {"none": 6, "fp32": 1, "bf16": 0.4, "fp16": 0.2})
    accum = _pick(rng, {1: 3, 2: 2, 3: 1})
    micro = _pick(rng, {1: 1, 2: 2})
    if model == "buffers":
        micro = 2  # batch norm needs two rows to train
    steps = rng.randint(3, 6)
    backward = _pick(rng, {"engine": 4, "torch": 1.5, "scale": 0.6})
    zero_grad = _pick(rng, {"none": 6, "boundary": 1, "micro": 0.7})
    no_sync = accum > 1 and rng.random() < 0.2
    evaluate = rng.random() < 0.15
    save = resume_world = 0
    universal = False
    if rng.random() < 0.22:
        save = rng.randint(1, steps - 1)
        if model != "tp" and rng.random() < 0.6:
            resume_world = rng.choice([w for w in (1, 2, 3, 4) if w % ep == 0])
        universal = rng.random() < 0.5
    case = Case(model=model, world=world, ep=ep, tp=tp, stage=stage, offload=offload, dtype=dtype,
                loss_scale=loss_scale, scale_power=scale_power, opt=opt, sched=sched, clip=clip, prescale=prescale,
                predivide=predivide, comm=comm, gad=gad, batch=rng.random() < 0.25, micro=micro, accum=accum,
                steps=steps, backward=backward, zero_grad=zero_grad, no_sync=no_sync, eval=evaluate, save=save,
                resume_world=resume_world if resume_world != world else 0, universal=universal)
    assert case.problem() is None, (case, case.problem())
    return case


# Cases nobody drew, one line each (Case.line's form): paths worth keeping whatever the seed draws.
EXTRA_CASES: List[str] = [
    "model=mlp world=2 stage=1 accum=2 steps=4 backward=torch",
    "model=mlp world=2 stage=2 accum=2 steps=4 backward=torch",
    "model=mlp world=2 stage=3 accum=2 steps=4 backward=torch",
    "model=mlp world=1 stage=2 opt=sgd backward=torch",
    "model=mlp world=1 stage=3 opt=sgd backward=torch",
    "model=mlp world=2 stage=0 accum=2 steps=4 backward=torch",
    "model=mlp world=2 stage=1 dtype=fp16 accum=2 backward=torch",
    "model=mlp world=2 stage=1 dtype=fp16 accum=2 backward=scale",
    "model=mlp world=2 stage=1 accum=2 no_sync=1",
    "model=mlp world=2 stage=2 accum=2 no_sync=1",
    "model=gpt world=2 stage=2 save=2 resume_world=4 steps=4",
    "model=gpt world=4 stage=3 save=2 resume_world=2 steps=4",
    "model=gpt world=2 stage=2 save=2 resume_world=4 steps=4 universal=1",
    "model=gpt world=4 stage=3 save=2 resume_world=2 steps=4 universal=1",
    "model=mlp world=2 stage=1 dtype=bf16 save=1 resume_world=3 universal=1",
    # engine.zero_grad() before every micro-step: lost at ZeRO 0-1, kept once reduced at ZeRO 2-3
    "model=mlp world=2 stage=1 opt=torch_adamw accum=3 zero_grad=micro",
    "model=mlp world=2 stage=2 opt=torch_adamw accum=3 zero_grad=micro",
    "model=mlp world=2 stage=3 opt=torch_adamw accum=3 zero_grad=micro",
    "model=tied world=2 stage=2 offload=opt opt=torch_adamw accum=3 zero_grad=micro",
]


def generate(seed: int = SEED, count: int = COUNT) -> List[Case]:
    """COUNT distinct cases drawn from SEED, then EXTRA_CASES (duplicates dropped)."""
    return draw_distinct(draw, Case, EXTRA_CASES, seed, count)


# -- comparing -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    why: str


# Per dtype, for per-step losses and final weights: |ours - DeepSpeed's| <= atol + rtol * |DeepSpeed's|.
TOLERANCES = {
    "fp32": Tolerance(1e-4, 1e-5, "the same fp32 arithmetic in another order (gradient sums over ranks, "
                                  "the fused Adam kernel against torch's ops, the global norm): a few ulp per "
                                  "step, which Adam's division by sqrt(v) can grow over 6 steps"),
    "bf16": Tolerance(3e-2, 2e-2, "bf16 keeps 8 significant bits (relative step 2^-8 = 0.4%): one rounding "
                                  "that falls the other way moves a weight by that much, and the next "
                                  "forward computes its loss with it"),
    "fp16": Tolerance(5e-3, 2e-3, "fp16 keeps 11 significant bits (relative step 2^-11 = 0.05%), with the "
                                  "same growth as bf16's over a few steps"),
}

def tolerance(case: Case) -> Tolerance:
    """The loosest of the dtypes the case computes, sums and accumulates gradients in."""
    order = ["fp32", "fp16", "bf16"]
    worst = max((d for d in (case.dtype, case.comm, case.gad) if d in order), key=order.index)
    return TOLERANCES[worst]


# -- where DeepSpeed's own answer cannot serve -----------------------------------------------------
@dataclass(frozen=True)
class Equivalent:
    """Cases `applies` to are checked against DeepSpeed's answer to the case with `change`
    made, which must train the same numbers: DeepSpeed refuses the case itself (`wrong`
    False: its answer is used when it gives one), or its answer is wrong (`wrong` True: never
    used). `why` says which."""

    applies: object
    change: Dict[str, object]
    why: str
    wrong: bool = False


EQUIVALENTS: List[Equivalent] = [
    Equivalent(lambda c: c.stage == 0 and c.dtype == "fp16", {"stage": 1, "allow_untested": True},
               "DeepSpeed 0.19.8's stage-0 fp16 engine.backward leaves the loss unscaled and its fp16 optimizer "
               "then divides the gradients by the scale (under Adam the scale mostly cancels, under SGD the "
               "steps are the scale times too small); its ZeRO-1 trains the same script as ZeRO-0 should",
               wrong=True),
    Equivalent(lambda c: c.stage == 0 and c.dtype == "bf16", {"stage": 1, "allow_untested": True},
               "DeepSpeed 0.19.8's stage-0 bf16 runs its fp16 optimizer wrappers, which train other numbers "
               "than its own ZeRO-1 on the same script; ZeRO-0 and ZeRO-1 compute the same update", wrong=True),
    Equivalent(lambda c: c.stage == 0 and c.backward != "engine", {"stage": 1, "allow_untested": True},
               "DeepSpeed refuses PyTorch-style backward at ZeRO stage 0; ZeRO-1 computes the same update"),
    Equivalent(lambda c: c.dtype == "fp16" and c.loss_scale == 0 and c.scale_power == 8, {"loss_scale": 256},
               "DeepSpeed 0.19.8 raises the dynamic loss scale before it unscales the step's gradients, so a "
               "step whose scale grows divides gradients scaled by 2^8 by 2^9 (half the step); with no overflow a "
               "dynamic scale that starts at 2^8 trains what the static scale 2^8 trains",
               wrong=True),
    Equivalent(lambda c: c.model in ("hf", "tp") and c.backward != "engine" and c.accum > 1 and c.stage in (1, 2),
               {"backward": "engine"},
               "DeepSpeed 0.19.8's PyTorch-style backward hooks every tensor of the forward's output, so a Hugging "
               "Face model's loss and logits both divide the gradient by the accumulation steps (1/gas^2 in all) at "
               "ZeRO 1-2; Adam mostly hides the scale, Adam with L2 decay shows it; its engine.backward trains what "
               "the script means", wrong=True),
    Equivalent(lambda c: c.prescale and c.stage >= 2, {"prescale": False},
               "DeepSpeed refuses prescale_gradients at ZeRO 2-3; dividing before or after the sum is the same "
               "arithmetic up to rounding"),
    Equivalent(lambda c: c.predivide != 1.0 and c.stage >= 2, {"predivide": 1.0},
               "DeepSpeed refuses gradient_predivide_factor at ZeRO 2-3; the factor divides before the sum and "
               "the rest after it, the same gradients up to rounding"),
    Equivalent(lambda c: c.model == "moe" and c.stage == 3, {"stage": 2},
               "DeepSpeed refuses its MoE layer at ZeRO-3; ZeRO-2 computes the same update"),
    Equivalent(lambda c: c.model == "moe" and c.opt == "client_adamw" and c.stage > 0,
               {"opt": "torch_adamw"},
               "DeepSpeed wants a client optimizer's expert parameters in param groups marked 'moe' at ZeRO 1-2; "
               "the config's torch AdamW is the same optimizer"),
    Equivalent(lambda c: c.model == "moe" and c.opt == "client_sgd" and c.stage > 0,
               {"opt": "sgd", "allow_untested": True},
               "DeepSpeed wants a client optimizer's expert parameters in param groups marked 'moe' at ZeRO 1-2; "
               "the config's SGD (momentum 0.9, the same rate) is the same optimizer"),
    Equivalent(lambda c: c.universal and c.stage == 0, {"universal": False},
               "DeepSpeed's ds_to_universal needs ZeRO optimizer files, which stage 0 does not write; a "
               "stage-0 checkpoint loads at any world size directly"),
    Equivalent(lambda c: c.save and c.resume_world and not c.universal and c.stage > 0, {"universal": True},
               "DeepSpeed loads a ZeRO checkpoint on another data-parallel world size only through "
               "ds_to_universal; we load it directly"),
]


def equivalent(case: Case) -> Tuple[Optional[Case], List[Equivalent]]:
    """The case DeepSpeed's answer to which stands for this case's (every rule that applies,
    applied until none changes it), with the rules used; (None, []) when none applies."""
    used: List[Equivalent] = []
    current = case
    for _ in range(len(EQUIVALENTS)):
        changed = False
        for rule in EQUIVALENTS:
            if rule not in used and rule.applies(current):
                current = dataclasses.replace(current, **rule.change)
                used.append(rule)
                changed = True
        if not changed:
            break
    if not used or current.problem() is not None:
        return None, []
    return current, used


CLASSES = ("equal", "equal to an equivalent case", "refused by both", "refused here only (listed)",
           "refused by DeepSpeed only", "DeepSpeed wrong, no equivalent", "open divergence (listed)", "divergence")

# Divergences found and not resolved yet, by case line, with what is known of each. They are
# classified apart; the test fails on any other divergence, and on a listed one that no longer
# diverges (so that this list stays true).
OPEN: Dict[str, str] = {}


# Cases whose DeepSpeed answer is wrong, the cause confirmed, where no case DeepSpeed trains
# right stands in (an equivalent would need a DeepSpeed that does not have the bug): classified
# "DeepSpeed wrong, no equivalent" with the reason. The test fails on a listed case that no
# longer diverges from DeepSpeed's own answer (so that this list stays true).
_GROWTH_BEFORE_UNSCALE = (
    "DeepSpeed 0.19.8's ZeRO step grows the dynamic fp16 scale (_update_scale) before unscale_and_clip_grads "
    "divides by it, so a step whose scale grows moves half its gradient; confirmed by running DeepSpeed with "
    "the growth moved after the unscale, which gives our losses and skipped steps")
DEEPSPEED_WRONG: Dict[str, str] = {
    "model=tied stage=1 offload=opt+param dtype=fp16 scale_power=16 opt=adagrad sched=warmup prescale=1 steps=4 "
    "zero_grad=boundary eval=1": _GROWTH_BEFORE_UNSCALE,
    "model=mlp world=2 stage=2 dtype=fp16 scale_power=16 opt=client_sgd batch=1 steps=5": _GROWTH_BEFORE_UNSCALE,
    "model=moe world=4 stage=2 dtype=fp16 scale_power=16 opt=adamw comm=fp32 gad=fp32 micro=1 accum=2 steps=5 "
    "eval=1": _GROWTH_BEFORE_UNSCALE,
    "model=tied dtype=fp16 scale_power=16 opt=client_sgd prescale=1 steps=4": _GROWTH_BEFORE_UNSCALE + " (against "
    "its ZeRO-1 equivalent)",
    "model=unused stage=1 offload=opt dtype=fp16 opt=lion sched=client predivide=2.0 accum=3 steps=5 "
    "backward=scale zero_grad=boundary no_sync=1":
        "DeepSpeed 0.19.8's CPU Lion (offload) steps by -copysign(lr, update): an update of +0, as every element "
        "of a layer forward never calls has, moves the weight by -lr each step (sign(0) is 0 in Lion and torch); "
        "the never-used layer's weights are Σlr apart, the losses and the other weights agree",
    "model=mlp world=4 stage=3 dtype=bf16 opt=adagrad sched=client clip=1.0 micro=1 steps=4":
        "DeepSpeed 0.19.8's ZeRO 1-3 replace a torch Adagrad with a new one over the flat fp32 partitions, while a "
        "client scheduler given as a callable is built on the optimizer it was given (engine.basic_optimizer), "
        "which no longer steps: the learning rate never moves. Confirmed on DeepSpeed: its stage-3 losses with "
        "the StepLR equal its losses with no scheduler (1.9144802, 1.3824923), and at stage 1 in fp32 on one "
        "rank its losses equal its own no-scheduler run while its stage-0 run, which keeps the optimizer, gives "
        "our stage-1 losses exactly",
    "model=mlp stage=1 opt=adagrad sched=client gad=bf16 batch=1 steps=6 backward=torch allow_untested=1":
        "DeepSpeed 0.19.8's ZeRO 1-3 replace a torch Adagrad with a new one over the flat fp32 partitions, while a "
        "client scheduler given as a callable is built on the optimizer it was given (engine.basic_optimizer), "
        "which no longer steps: the learning rate never moves. Confirmed on DeepSpeed: the same case without the "
        "scheduler gives its recorded losses (5.5071130, 2.1815097, 1.4881861, 1.4671140, 0.3743645), and ours "
        "without the scheduler equal them",
}


@dataclass
class Verdict:
    kind: str
    detail: str = ""


def close(a: List[float], b: List[float], tol: Tolerance) -> Tuple[bool, float]:
    """Whether every element of `a` is within `tol` of `b`'s, and the worst excess ratio."""
    if len(a) != len(b):
        return False, float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if x != x or y != y:  # nan
            if (x != x) != (y != y):
                return False, float("inf")
            continue
        bound = tol.atol + tol.rtol * abs(y)
        worst = max(worst, abs(x - y) / bound)
    return worst <= 1.0, worst


def classify(case: Case, ds: dict, ours: dict, listed, twin: Optional[dict] = None,
             rules: Optional[List[Equivalent]] = None) -> Verdict:
    """`ds`, `ours`: a run's result ({"losses", ...} or {"error": line}); `listed(message)`:
    whether docs/configuration.md lists the reason of our refusal; `twin`: DeepSpeed's answer
    to equivalent(case)'s case, with `rules` the reasons it stands for this one."""
    rules = rules or []
    wrong = any(r.wrong for r in rules)
    if "error" in ours:
        if "error" in ds:
            if ours.get("lines", 1) != 1:
                return Verdict("divergence", f"both refuse, ours not in one line: {ours['error']}")
            return Verdict("refused by both", f"DeepSpeed: {ds['error']} | here: {ours['error']}")
        if ours.get("lines", 1) == 1 and listed(ours["error"]):
            return Verdict("refused here only (listed)", ours["error"])
        return Verdict("divergence", f"DeepSpeed runs it; here: {ours['error']} (not listed in docs/configuration.md)")
    if "error" in ds or wrong:
        if twin is None or "error" in twin:
            if "error" in ds:
                return Verdict("refused by DeepSpeed only", ds["error"])
            # DeepSpeed answers, wrongly (a listed rule says why), and no right answer of its stands in
            return Verdict("DeepSpeed wrong, no equivalent", "; ".join(r.why for r in rules if r.wrong))
        problems = compare_runs(case, twin, ours)
        if problems:
            return Verdict("divergence", f"against the equivalent case ({'; '.join(r.why for r in rules)}): "
                                         + "; ".join(problems))
        return Verdict("equal to an equivalent case", "; ".join(r.why for r in rules))
    problems = compare_runs(case, ds, ours)
    if problems:
        return Verdict("divergence", "; ".join(problems))
    return Verdict("equal")


# Parameters whose final values are not compared, per model, with the reason: their true
# gradient is zero, so what they receive is rounding noise, which an optimizer that normalises
# its step (Adam, Lion) turns into full-size steps that differ from run to run.
NOISE_PARAMS: Dict[str, Dict[str, str]] = {
    "buffers": {"a.bias": "batch norm subtracts the batch mean right after it"},
}


def compare_runs(case: Case, ds: dict, ours: dict) -> List[str]:
    tol = tolerance(case)
    problems = []
    for key in ("losses", "eval"):
        ok, worst = close(ours.get(key, []), ds.get(key, []), tol)
        if not ok:
            problems.append(f"{key} differ (worst {worst:.3g}x the tolerance): DeepSpeed {_short(ds.get(key))}, "
                            f"here {_short(ours.get(key))}")
    for key in ("global_steps", "skipped_steps"):
        if ds.get(key) != ours.get(key):
            problems.append(f"{key}: DeepSpeed {ds.get(key)}, here {ours.get(key)}")
    if ds.get("weights") is not None:
        if ours.get("weight_names") != ds.get("weight_names") or len(ours["weights"]) != len(ds["weights"]):
            problems.append("the module's parameters differ in names, order or sizes")
        else:
            bad = tensors_apart(ours["weights"], ds["weights"], ours["weight_sizes"], ours["weight_names"], tol)
            bad = [(n, r) for n, r in bad if n not in NOISE_PARAMS.get(case.model, {})]
            if bad:
                problems.append("final weights differ: " + ", ".join(f"{n} ({r:.3g}x the tolerance)" for n, r in bad))
    return problems


def tensors_apart(a: List[float], b: List[float], sizes: List[int], names: List[str],
                  tol: Tolerance) -> List[Tuple[str, float]]:
    """The parameters whose values are apart: ||a - b|| > atol sqrt(n) + rtol ||b|| over each
    parameter's n values. Over the whole tensor rather than per value: under a low precision,
    an optimizer that normalises the step (Adam, Lion) turns a gradient that rounding moved
    across zero into a full step the other way, in one value of many; a parameter that trains
    differently moves all of them."""
    out, start = [], 0
    for name, n in zip(names, sizes):
        x, y = a[start:start + n], b[start:start + n]
        start += n
        dist = sum((p - q) ** 2 for p, q in zip(x, y)) ** 0.5
        norm = sum(q * q for q in y) ** 0.5
        bound = tol.atol * n ** 0.5 + tol.rtol * norm
        if not dist <= bound:
            out.append((name, dist / bound if bound else float("inf")))
    return out


def _short(values) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in (values or [])) + "]"
