"""A per-rank memory and time breakdown picture of a simulated plan (matplotlib PNG)."""
from __future__ import annotations

GB = 1e9
_COLORS = {"params": "#4a7bd0", "param_copies": "#8fb0e8", "grads": "#e0a030", "optimizer_state": "#c0504d",
           "activations": "#70a860", "buffers": "#999999", "step_state": "#b080c0", "workspace": "#d8d8a0"}


def _ranks(sim) -> list[tuple[str, dict[str, float], float]]:
    """(label, memory terms, seconds busy) per rank shown: every pipeline rank, or the simulated one."""
    if sim.stages:
        return [(f"pp {st['rank']}" + (f"\nlayers {sum(st['layers'])}" if None not in st["layers"] else ""),
                 st["memory"], st["busy_s"]) for st in sim.stages]
    return [(f"rank {sim.rank}", sim.memory, sim.compute_seconds)]


def plot_breakdown(sim, path: str, title: str | None = None) -> str:
    """Write ``path``: per rank, memory stacked by term against the device's capacity; the step's time split."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = _ranks(sim)
    terms = list(dict.fromkeys(k for _, mem, _ in ranks for k in mem))
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 1.6 + 0.45 * len(ranks) + 1.5),
                                          gridspec_kw={"width_ratios": [3, 2]})
    labels = [label for label, _, _ in ranks]
    left = [0.0] * len(ranks)
    for term in terms:
        widths = [mem.get(term, 0) / GB for _, mem, _ in ranks]
        ax_mem.barh(labels, widths, left=left, color=_COLORS.get(term, "#cccccc"), label=term)
        left = [a + b for a, b in zip(left, widths)]
    ax_mem.axvline(sim.capacity_bytes / GB, color="black", linestyle="--", linewidth=1,
                   label=f"usable {sim.capacity_bytes / GB:.1f} GB")
    if not sim.stages:   # the node-order peak (terms + transient working memory) of the simulated rank
        ax_mem.axvline(sim.peak_bytes / GB, color="#c00000", linewidth=1.5, label=f"peak {sim.peak_bytes / GB:.2f} GB")
    largest = sim.largest_term
    ax_mem.set_xlabel("GB per rank")
    ax_mem.set_title(f"memory: peak {sim.peak_bytes / GB:.2f} GB ({'fits' if sim.fits else 'does NOT fit'}), "
                     f"largest term {largest}", fontsize=9)
    ax_mem.invert_yaxis()
    ax_mem.legend(fontsize=7, loc="lower right")

    parts = [("compute", sim.compute_seconds)]
    if sim.pp > 1:
        parts.append((f"pipeline bubble + transfers ({sim.bubble_fraction:.0%})",
                      max(0.0, sim.timeline.makespan - sim.compute_seconds)))
        parts.append(("optimizer + exposed dp comm", max(0.0, sim.step_seconds - sim.timeline.makespan)))
    else:
        parts.append(("exposed communication", sim.exposed_comm_seconds))
    ax_time.barh([p for p, _ in parts], [s * 1e3 for _, s in parts], color=["#4a7bd0", "#c0504d", "#e0a030"][:len(parts)])
    ax_time.invert_yaxis()
    ax_time.set_xlabel("ms per step")
    ax_time.set_title(f"step {sim.step_seconds * 1e3:.1f} ms, MFU {sim.mfu():.1%}, "
                      f"{sim.tokens_per_second_per_device:,.0f} tokens/s/device", fontsize=9)
    p = sim.plan
    fig.suptitle(title or f"dp={p.dp} tp={p.tp} pp={sim.pp} zero={p.zero_stage} recompute={p.recompute} "
                          f"mb={p.microbatches} {p.precision} on {sim.profile}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
