"""What the tuner prints when it is done: the before/after table and how to give the file back."""

from __future__ import annotations

from pathlib import Path

from coreattn.tune.space import describe_config


def after_table(results, key) -> str:
    """One row per (kernel, class): the shipped config and its time, the chosen one and its time
    (ms summed over the batches), the speedup (geometric mean of the per-batch ratios) and why
    candidates were dropped. Times are this GPU's, measured just now."""
    header = ["class", "kernel", "shipped", "ms", "tuned", "ms", "speedup", "note"]
    lines = []
    for r in results:
        same = r.chosen == r.shipped
        notes = f"{len(r.notes)} dropped/rejected" if r.notes else ""
        lines.append([r.task.cls.id, r.task.kernel, describe_config(r.shipped), f"{sum(r.ms_shipped.values()):.3f}",
                      "(not tuned: failed)" if getattr(r, "failed", None) else "(shipped kept)" if same
                      else describe_config(r.chosen), f"{sum(r.ms_chosen.values()):.3f}",
                      f"{r.speedup:.2f}x", notes])
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    text = [f"\nMeasured on {key.gpu} (compute capability {key.capability}), triton {key.triton}, coreattn "
            f"{key.coreattn}. ms: the op the kernel runs in (forward; backward = preprocess + dK/dV + dQ, the other "
            "kernels at their shipped configs), summed over the batches; speedup: geometric mean over the batches "
            "of shipped ms / tuned ms.",
            fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*line) for line in lines]
    for r in results:
        for note in r.notes:
            text.append(f"  {r.task.kernel} {r.task.cls.id}: {note}")
    return "\n".join(text)


def share_hint(path: Path, key, n_entries: int) -> str:
    if not n_entries:
        return (f"\nNo candidate beat the shipped configs here; {path} holds no entries for these classes. "
                "That is a result worth reporting too (an issue with this table).")
    return (f"\nWrote {n_entries} tuned entr{'y' if n_entries == 1 else 'ies'} to {path}; coreattn's kernels use them "
            f"from now on in processes on this GPU with these versions.\nTo give them to everyone with a {key.gpu}: "
            "open a pull request adding that file under coreattn/kernels/tuned/ (or attach it to an issue), with "
            "the table above and the output of python -m coreattn.selfcheck.")
