"""Write models/<draft>/MANIFEST.md from the training record and the evaluation results.

    python -m training.manifest        # after training.train_* and benchmarks.training.draft_eval

Each manifest says what the weights are, the exact commands that made them, the data, the
learning curve, and the acceptance measured on held-out prompts (benchmarks/results/draft_eval.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.common import DRAFT_DIR, EAGLE_DIR, REPO_ROOT, data_dir, work_dir

EVAL_JSON = REPO_ROOT / "benchmarks" / "results" / "draft_eval.json"

COMMON_CMDS = """```
nice -n 19 python -m training.datagen --max-shards 10 --threads 1 --minutes 60  # 640 prompts: responses + hidden states
{train}
nice -n 19 python -m benchmarks.training.draft_eval               # acceptance / speed / cost -> benchmarks/results/
python -m training.manifest                                      # this file
```"""


def _curve_table(curve: dict[str, Any], keys: list[str]) -> str:
    lines = ["| step | minutes | " + " | ".join(keys) + " |", "|" + "---|" * (2 + len(keys))]
    steps = curve.get("step", [])
    for i, s in enumerate(steps):
        vals = [str(curve.get("val_" + k, [None] * len(steps))[i]) for k in keys]
        lines.append(f"| {s} | {curve['minutes'][i]} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def _acceptance(ev: dict[str, Any], method: str) -> str:
    rows = [r for r in ev["acceptance"] if r["method"] == method]
    lines = [
        "| prompts | sampling | K | mean acceptance length | acceptance rate "
        "| accepted at draft 1, 2, ... (of drafts) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = "greedy" if r["temperature"] == 0 else f"T={r['temperature']}"
        per_pos = ", ".join(str(n) for n in r.get("accepted_per_pos") or []) or "-"
        lines.append(
            f"| {'held-out chat' if r['set'] == 'chat' else 'copy-heavy'} | {t} | {r['k']} | "
            f"{r['mean_acceptance_length']:.2f} | {r['acceptance_rate']:.2f} | {per_pos} ({r['num_drafts']}) |"
        )
    return "\n".join(lines)


def _speed(ev: dict[str, Any], method: str) -> str:
    rows = [r for r in ev["speed_c1"] if r["method"] == "plain" or r["method"].startswith(method + " ")]
    return "\n".join(f"- {r['method']}: {r['tok_s']:.1f} tok/s ({r['vs_plain']:.2f}x plain)" for r in rows)


def write(kind: str, d: Path, ev: dict[str, Any] | None) -> None:
    tr = json.loads((d / "training.json").read_text())
    meta_path = data_dir() / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    a = tr["args"]
    n_shards = len(list(data_dir().glob("shard_*.pt")))
    used = n_shards * meta.get("args", {}).get("shard", 0) or "?"
    if kind == "draft":
        title = "smollm2-draft: a 3-layer draft model distilled from SmolLM2-135M-Instruct"
        what = (
            f"A Hugging Face Llama directory (bf16 safetensors + the target's tokenizer files): the target's "
            f"embedding / tied LM head (frozen) and {len(tr['init_layers'])} decoder layers initialised from "
            f"the target's layers {tr['init_layers']}, then distilled, and `draft_vocab.json`, the token ids the "
            f"distillation covered, among which the proposer drafts (its LM head has only those rows). Loads with "
            f"`workers.model_loader.load_model('models/smollm2-draft')`; used by the `draft_model` proposer "
            f"(ray_config.yaml `draft.model`)."
        )
        train_cmd = (
            "nice -n 19 python -m training.train_draft --layers {layers} --epochs {epochs} --max-minutes "
            "{max_minutes} --threads {threads}"
        ).format(**a)
        loss = (
            f"KL(target || draft) over the draft vocabulary ({a['draft_vocab']} most frequent tokens, "
            f"{tr['draft_vocab_coverage_val']:.1%} of validation response tokens) + {a['ce_weight']} x CE on "
            f"the target's next token; AdamW lr {a['lr']}, warmup + cosine, {a['batch_tokens']} tokens/batch."
        )
        keys, method = ["top1", "kl"], "draft_model"
    else:
        title = "smollm2-eagle: an EAGLE draft head for SmolLM2-135M-Instruct"
        what = (
            "fc (2 x 576 -> 576) + one Llama decoder layer over [target final-norm feature f_j ; embedding of "
            "t_{j+1}], predicting f_{j+1}; scored through the target's frozen LM head restricted to "
            f"{a['draft_vocab']} draft-vocabulary rows (`d2t`). fp16 safetensors + `eagle_config.json`; the "
            "embedding and LM head are the target's and are not stored. Used by the `eagle` proposer "
            "(workers/proposers/eagle.py; ray_config.yaml `draft.eagle`)."
        )
        init = tr.get("init_training")  # a fine-tuning run names the run it started from
        stages = [init, tr] if init else [tr]
        cmds = []
        for st in stages:
            sa = st["args"]
            cmd = (
                "nice -n 19 python -m training.train_eagle "
                "--epochs {epochs} --max-minutes {max_minutes} --threads {threads}"
            )
            if sa.get("ttt_steps", 1) > 1:
                cmd += " --ttt-steps {ttt_steps} --ttt-decay {ttt_decay} --lr {lr} --init {init}"
            cmds.append(cmd.format(**sa))
        train_cmd = "\n".join(cmds)
        first = stages[0]["args"]
        loss = (
            f"smooth-L1(f^_{{j+1}}, f_{{j+1}}) + {first['p_weight']} x CE(target distribution, head distribution) "
            f"over the draft vocabulary ({tr['draft_vocab_coverage_val']:.1%} of validation response tokens), "
            f"input noise U(+-{first['noise']} x feature RMS); layer initialised from the target's last layer, "
            f"fc = [I | I]; AdamW lr {first['lr']}, warmup + cosine, {first['batch_tokens']} tokens/batch."
        )
        if init:
            loss += (
                f" Then fine-tuned with the training-time test (EAGLE-3): the same loss on drafts 1 .. "
                f"{a['ttt_steps']} of the unrolled chain, where the head reads its own predicted features, "
                f"step s weighted {a['ttt_decay']}^(s-1); AdamW lr {a['lr']}; the kept checkpoint maximises "
                f"1 + a1 + a1 a2 + ... over the per-step validation top-1 a_s."
            )
        keys, method = ["top1", "acc_next", "vloss"], "eagle"
        if a.get("ttt_steps", 1) > 1:
            keys = ["top1"] + [f"top1_{s}" for s in range(2, a["ttt_steps"] + 1)] + ["accept_len", "vloss"]
    curve = tr["curve"]
    parts = [
        f"# {title}",
        "",
        "## What",
        what,
        "",
        "## Data",
        f"Prompts: template-generated (training/prompts.py: explanations, comparisons, how-tos, lists, stories, "
        f"emails, code, math word problems, summaries, rewriting / copying), {used} training prompts (the first "
        f"{n_shards} shards of the {meta.get('num_prompts', '?')} the generator lists); responses: the target's "
        f"own outputs from our engine (fp32; greedy, and "
        f"{meta.get('args', {}).get('sampled_frac', '?')} of prompts sampled at T=0.7; max "
        f"{meta.get('args', {}).get('max_tokens', '?')} tokens) with its final-norm hidden states. "
        f"{tr['num_train_sequences']} training sequences ({tr['train_response_tokens']} response tokens), "
        f"{tr['num_val_sequences']} validation sequences. Evaluation uses held-out prompts whose subjects never "
        f"occur in training (tests/test_training_data.py checks disjointness).",
        "",
        "## How",
        COMMON_CMDS.format(train=train_cmd),
        "",
        loss,
        "",
    ]
    first = tr["init_training"]["curve"] if kind == "eagle" and tr.get("init_training") else None
    if first is None:
        parts += [
            f"Training time: {curve.get('train_minutes', ['?'])[0]} min on the 2-core dev CPU (shared); "
            f"finished all steps: {curve.get('finished', ['?'])[0]}; kept the best validation checkpoint "
            f"(step {curve.get('best_step', ['?'])[0]}).",
            "",
            "## Learning curve (validation, training prompts' held-back responses)",
            _curve_table(curve, keys),
            "",
        ]
    else:  # two stages: say both, and show both curves
        parts += [
            f"Training time: {first.get('train_minutes', ['?'])[0]} min (first stage, kept step "
            f"{first.get('best_step', ['?'])[0]}), then {curve.get('train_minutes', ['?'])[0]} min of "
            f"training-time-test fine-tuning (finished all steps: {curve.get('finished', ['?'])[0]}; kept "
            f"step {curve.get('best_step', ['?'])[0]}), on the 2-core dev CPU.",
            "",
            "## Learning curve, first stage (validation, training prompts' held-back responses)",
            _curve_table(first, ["top1", "acc_next", "vloss"]),
            "",
            "## Learning curve, training-time-test fine-tuning (same validation set; top1_s: draft s)",
            _curve_table(curve, keys),
            "",
        ]
    if ev is not None:
        c = ev["cost"]
        parts += [
            "## Measured (benchmarks/results/draft_eval.json)",
            "",
            f"Held-out chat prompts: {len(ev['chat_prompts'])}; "
            "copy-heavy: benchmarks/speculation/spec_bench.py COPY_PROMPTS; "
            f"{ev['tokens']} tokens per request.",
            "",
            _acceptance(ev, method),
            "",
            "Concurrency 1, held-out chat, greedy:",
            _speed(ev, method),
            "",
            (
                f"Per-token cost (1-token step, batch 1, fp32, median): draft {c['draft_step_ms']:.1f} ms vs target "
                f"{c['target_step_ms']:.1f} ms = {c['draft_over_target']:.3f} of the target."
                if kind == "draft"
                else f"Per-token cost (one drafting step, batch 1, fp32, median): {c['eagle_step_ms']:.2f} ms "
                f"vs target {c['target_step_ms']:.1f} ms = {c['eagle_over_target']:.3f} of the target."
            ),
        ]
    runs = [kind]  # work directories of the runs that made these weights, in order (as train_eagle names them)
    if first is not None:
        runs.append(f"eagle-ttt{a['ttt_steps']}")
    logs = [work_dir(r) / f"{kind}.log" for r in runs]
    if all(log.exists() for log in logs):  # the runs' own progress logs (every invocation, resumes included)
        with open(d / "training.log", "w") as out:
            for log in logs:
                out.write(log.read_text())
        parts += [
            "",
            "The full progress log of the run"
            + ("s" if len(runs) > 1 else "")
            + ", resumes included, is `training.log` next to this file.",
        ]
    (d / "MANIFEST.md").write_text("\n".join(parts) + "\n")
    print(f"wrote {d / 'MANIFEST.md'}")


def main() -> int:
    ev = json.loads(EVAL_JSON.read_text()) if EVAL_JSON.exists() else None
    write("draft", DRAFT_DIR, ev)
    write("eagle", EAGLE_DIR, ev)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
