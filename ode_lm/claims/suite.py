"""Every claim the suite checks: the paper's statement, the runs it needs, one statistic per
seed, and the threshold that judges it, fixed here before any run that it judges.

A claim's ``measure(ctx, seed)`` returns ``(value, evidence)``: the statistic of that seed and
the figures beside it (the report prints them; ``claims.json`` keeps them). ``Context`` builds
the runs (``Context.ode``, ``baseline``, ``finetune``) from the suite's corpus and scale gin
files, so every claim on one seed shares the same runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ode_lm.claims import statistics as stats
from ode_lm.claims.runs import Runs, RunSpec
from ode_lm.claims.verdict import Threshold
from ode_lm.training.metric_names import PERPLEXITY, name

RUN = "runs/demo.gin"  # the demo: tiny, the default recipe, its depth sweep in the final eval
BASELINE = "runs/baseline_demo.gin"  # the same width, data and schedule, six discrete layers
FINETUNE = "claims/finetune.gin"
RECIPES = {"default": None, "depth_robust": "recipes/depth_robust.gin",
           "paper": "recipes/paper.gin"}
OWN_N = 6  # the demo's ODE_STEPS: every ODE run's own N
FINETUNE_DEPTHS = (3, 12)
FINETUNE_METHODS = ("full", "lora")
NO_SWEEP = ("TrainConfig.eval_solves = ()",)


def ppl(record: dict, setting: str = "") -> float:
    """A run's validation perplexity at its own solve (``""``) or at ``@steps=N`` etc."""
    return float(record["eval"][name(PERPLEXITY, setting)])


def pct(a: float, b: float) -> float:
    """a relative to b, in %."""
    return 100.0 * (a / b - 1.0)


@dataclasses.dataclass
class Context:
    runs: Runs
    data_files: tuple[str, ...] = ()  # the corpus (nothing: the built-in one)
    scale_files: tuple[str, ...] = ("claims/tiny.gin",)

    def _spec(self, label: str, files: list[str], bindings: list[str], seed: int,
              **kw: Any) -> RunSpec:
        return RunSpec(label, (*files, *self.data_files, *self.scale_files), tuple(bindings),
                       seed, **kw)

    def ode(self, recipe: str, seed: int) -> dict:
        """The demo's ODE trained with ``recipe``: the default evaluates the demo's sweep;
        the paper's recipe also at the fine-tuning depths; depth-robust at its own N."""
        return self.runs.get(self.ode_spec(recipe, seed))

    def ode_spec(self, recipe: str, seed: int) -> RunSpec:
        files = [RUN] + ([RECIPES[recipe]] if RECIPES[recipe] else [])
        bindings = {"default": [], "depth_robust": list(NO_SWEEP),
                    "paper": ["TrainConfig.eval_solves = "
                              f"{tuple(f'steps={n}' for n in FINETUNE_DEPTHS)}"]}[recipe]
        return self._spec(f"ode-{recipe}", files, bindings, seed)

    def baseline(self, arch: str, seed: int, steps: int | None = None) -> dict:
        return self.runs.get(self.baseline_spec(arch, seed, steps))

    def baseline_spec(self, arch: str, seed: int, steps: int | None = None) -> RunSpec:
        bindings = [f"ModelConfig.architecture = '{arch}'"]
        if steps is not None:
            bindings.append(f"TRAIN_STEPS = {steps}")
        label = arch + (f"-{steps}steps" if steps is not None else "")
        return self._spec(label, [BASELINE], bindings, seed)

    def equal_flops_baseline(self, arch: str, seed: int) -> tuple[dict, int]:
        """The baseline trained for the steps whose FLOPs equal the default ODE's (the
        trainer's own count for both, extra solves of the recipe included)."""
        ode = self.ode("default", seed)
        tokens = self.baseline(arch, seed)
        per_step = tokens["training_flops"] / tokens["step"]
        steps = max(1, round(ode["training_flops"] / per_step))
        return self.baseline(arch, seed, steps), steps

    def finetune(self, depth: int, method: str, seed: int) -> dict:
        pre = self.ode_spec("paper", seed)
        files = [RUN, RECIPES["paper"], FINETUNE]
        bindings = [f"FINETUNE_STEPS = {depth}", f"METHOD = '{method}'"]
        return self.runs.get(self._spec(f"finetune-{method}{depth}", files, bindings, seed,
                                        kind="finetune", pretrained=pre))


Measure = Callable[[Context, int], tuple[float, dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Claim:
    id: str
    paper: str  # the statement, and where the paper makes it
    statistic: str  # what one seed's value is, in words
    threshold: Threshold
    measure: Measure
    group: str  # the report's section


CLAIMS: list[Claim] = []


def claim(id: str, group: str, paper: str, statistic: str, threshold: Threshold):
    def register(measure: Measure) -> Measure:
        CLAIMS.append(Claim(id, paper, statistic, threshold, measure, group))
        return measure
    return register


# ------------------------------------------------------------------ ODE against discrete
COMPARABLE = Threshold("<=", 2.0, " %")  # "comparable to or better than": at most 2 % worse


def _against_baselines(ctx: Context, seed: int, recipe: str, flops: bool) -> tuple[float, dict]:
    ode = ctx.ode(recipe, seed)
    ev: dict[str, Any] = {"ode_ppl": ppl(ode), "ode_params": ode["params"]["total"],
                          "ode_training_flops": ode["training_flops"]}
    best = None
    for arch in ("sequential", "parallel"):
        if flops:
            base, steps = ctx.equal_flops_baseline(arch, seed)
            ev[f"{arch}_steps"] = steps
        else:
            base = ctx.baseline(arch, seed)
        ev[f"{arch}_ppl"] = ppl(base)
        ev[f"{arch}_params"] = base["params"]["total"]
        ev[f"{arch}_training_flops"] = base["training_flops"]
        best = ppl(base) if best is None else min(best, ppl(base))
    return pct(ppl(ode), best), ev


for _recipe in ("paper", "default"):
    claim(f"ode-vs-discrete-tokens-{_recipe}", "ODE against discrete transformers",
          "DiffEqFormer performs comparably to or better than vanilla transformers of the same "
          "width (Section 6, Tables 1 and 2: GPT/Llama baselines, equal training tokens)",
          f"ODE ({_recipe} recipe, Euler N=6) perplexity relative to the better of the "
          "sequential and parallel six-layer baselines, equal tokens",
          COMPARABLE)(lambda ctx, seed, r=_recipe: _against_baselines(ctx, seed, r, False))

claim("ode-vs-discrete-flops-default", "ODE against discrete transformers",
      "as above, at equal training compute (not a claim of the paper, whose comparison is at "
      "equal tokens: the hypernetwork and the default recipe's extra solves cost FLOPs)",
      "ODE (default recipe) perplexity relative to the better baseline trained for the same "
      "training FLOPs (more steps)",
      COMPARABLE)(lambda ctx, seed: _against_baselines(ctx, seed, "default", True))


# ------------------------------------------------------------------ spectra
def _spectra(ctx: Context, seed: int, recipe: str) -> dict:
    return ctx.runs.stat(ctx.ode_spec(recipe, seed), "spectra", stats.spectra_stats)


def _baseline_spectra(ctx: Context, seed: int) -> dict[str, Any]:
    out = {}
    for arch in ("sequential", "parallel"):
        s = ctx.runs.stat(ctx.baseline_spec(arch, seed), "spectra", stats.spectra_stats)
        out[f"{arch}_qk_rank_correlation"] = s["qk_rank_correlation"]
        out[f"{arch}_ov_positive_real_last_layer"] = s["ov_positive_real_near_output"]
    return out


def _qk(ctx: Context, seed: int, recipe: str) -> tuple[float, dict]:
    s = _spectra(ctx, seed, recipe)
    return s["qk_rank_correlation"], {"last_first_ratio": s["qk_last_first_ratio"],
                                      **_baseline_spectra(ctx, seed)}


def _ov(ctx: Context, seed: int, recipe: str) -> tuple[float, dict]:
    s = _spectra(ctx, seed, recipe)
    ev = _baseline_spectra(ctx, seed)
    return s["ov_positive_real_near_output"], {
        "ov_positive_real_t0": s["ov_positive_real"][0],
        **{k: v for k, v in ev.items() if k.startswith(("sequential_ov", "parallel_ov"))}}


for _recipe in ("paper", "default"):
    claim(f"qk-grows-with-depth-{_recipe}", "Spectra",
          "the magnitudes of the QK eigenvalues increase with depth t (Section 4, spectral "
          "analysis: evidence against the weight-sharing assumption)",
          f"Spearman's rank correlation of the median |λ(QK)| with t over {stats.NUM_TIMES} "
          f"points in [0, 1] ({_recipe} recipe; baselines per layer as a control)",
          Threshold(">=", 0.5))(lambda ctx, seed, r=_recipe: _qk(ctx, seed, r))
    claim(f"ov-attractive-near-output-{_recipe}", "Spectra",
          "the OV spectrum turns attractive (eigenvalues with negative real part dominate) "
          "near the output, t → 1 (Section 4)",
          f"fraction of OV eigenvalues with Re λ > 0 over t >= {stats.NEAR_OUTPUT} "
          f"({_recipe} recipe)",
          Threshold("<=", 0.4))(lambda ctx, seed, r=_recipe: _ov(ctx, seed, r))


# ------------------------------------------------------------------ Lyapunov
def _lyapunov(ctx: Context, seed: int, recipe: str) -> tuple[float, dict]:
    s = ctx.runs.stat(ctx.ode_spec(recipe, seed), "lyapunov", stats.lyapunov_stats)
    return s["median_rho"], {"recency_rho": s["median_recency_rho"],
                             "texts": len(s["rho"])}


for _recipe in ("paper", "default"):
    claim(f"lyapunov-token-sensitivity-{_recipe}", "Lyapunov exponents",
          "the maximum Lyapunov exponent of a token measures how sensitive the prediction is "
          "to it, a token-level attribution beyond attention weights (Section 5)",
          f"median over {stats.LYAPUNOV_TEXTS} validation texts ({stats.LYAPUNOV_TOKENS} "
          "tokens) of Spearman's ρ between each earlier token's maximum exponent and the KL "
          f"change of the last prediction when that token is occluded ({_recipe} recipe; "
          "recency's ρ as a control)",
          Threshold(">=", 0.3))(lambda ctx, seed, r=_recipe: _lyapunov(ctx, seed, r))


# ------------------------------------------------------------------ adaptive fine-tuning
RECOVERY_MARGIN = Threshold("<=", 5.0, " %")
NO_WORSE = Threshold("<=", 0.5, " %")


def _finetune(ctx: Context, seed: int, depth: int, method: str) -> tuple[float, dict]:
    pre = ctx.ode("paper", seed)
    ft = ctx.finetune(depth, method, seed)
    own = ppl(pre)
    ev: dict[str, Any] = {"pretrained_own_n_ppl": own, "finetuned_ppl": ppl(ft),
                          "finetune_steps": ft["step"], "pretrain_steps": pre["step"],
                          "trainable": ft["trainable"]}
    if depth != OWN_N:
        ev["before_ppl"] = ppl(pre, f"@steps={depth}")
        ev["default_recipe_at_m_ppl"] = ppl(ctx.ode("default", seed), f"@steps={depth}")
    return pct(ppl(ft), own), ev


for _m in FINETUNE_DEPTHS:
    for _method in FINETUNE_METHODS:
        claim(f"finetune-recovers-m{_m}-{_method}", "Adaptive fine-tuning",
              "a model pretrained at N steps, fine-tuned (fully or with LoRA) at a new M, "
              "recovers its performance (Section 6, adaptive fine-tuning)",
              f"paper-recipe model pretrained at N={OWN_N}, fine-tuned at M={_m} ({_method}) "
              "for 20 % of its pretraining steps: perplexity at M relative to the pretrained "
              f"model's at N={OWN_N}",
              RECOVERY_MARGIN)(lambda ctx, seed, m=_m, k=_method: _finetune(ctx, seed, m, k))
for _method in FINETUNE_METHODS:
    claim(f"finetune-own-n-no-worse-{_method}", "Adaptive fine-tuning",
          "fine-tuning at the model's own N does not make it worse (a sanity check of the "
          "fine-tuning setup, not a claim of the paper)",
          f"paper-recipe model fine-tuned at its own N={OWN_N} ({_method}): perplexity "
          "relative to before",
          NO_WORSE)(lambda ctx, seed, k=_method: _finetune(ctx, seed, OWN_N, k))


# ------------------------------------------------------------------ the default recipe
def _gap(ctx: Context, seed: int, settings: tuple[str, ...]) -> tuple[float, dict]:
    run = ctx.ode("default", seed)
    gaps = {s: pct(ppl(run, s), ppl(run)) for s in settings}
    return max(gaps.values()), {"own_n_ppl": ppl(run), **{f"gap{s}": g for s, g in gaps.items()}}


DEPTH_TARGETS = [
    ("euler2", ("@steps=2",), 15.0),
    ("euler3", ("@steps=3",), 5.0),
    ("euler4-24", ("@steps=4", "@steps=8", "@steps=12", "@steps=24"), 3.0),
    ("rk4", ("@rk4:steps=8",), 3.0),
    ("adaptive", ("@adaptive:rtol=0.001",), 3.0),
]
for _name, _settings, _limit in DEPTH_TARGETS:
    claim(f"default-depth-{_name}", "The default recipe (ode-lm's own claims)",
          "one set of weights holds at every N and solver (ode-lm's default recipe; not a "
          "claim of the paper, whose recipe holds only at its own N)",
          f"largest gap of {', '.join(s[1:] for s in _settings)} to Euler N={OWN_N}",
          Threshold("<=", _limit, " %"))(lambda ctx, seed, s=_settings: _gap(ctx, seed, s))


def _n6_price(ctx: Context, seed: int) -> tuple[float, dict]:
    default, robust = ctx.ode("default", seed), ctx.ode("depth_robust", seed)
    return pct(ppl(default), ppl(robust)), {"default_ppl": ppl(default),
                                            "depth_robust_ppl": ppl(robust)}


claim("default-depth-n6-price", "The default recipe (ode-lm's own claims)",
      "the default recipe's breadth costs little at its own N",
      f"Euler N={OWN_N} perplexity of the default recipe relative to the depth-robust "
      "recipe's, paired by seed",
      Threshold("<=", 1.0, " %"))(_n6_price)


def select(ids: list[str] | None) -> list[Claim]:
    """The claims named (an id, or a prefix ending in ``*``); all when ``ids`` is None."""
    if not ids:
        return list(CLAIMS)
    chosen = []
    for want in ids:
        hits = [c for c in CLAIMS if c.id == want
                or (want.endswith("*") and c.id.startswith(want[:-1]))]
        if not hits:
            raise ValueError(f"--claims={want}: no such claim; known: "
                             f"{', '.join(c.id for c in CLAIMS)}")
        chosen += [c for c in hits if c not in chosen]
    return chosen
