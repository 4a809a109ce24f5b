"""The one-page profile report: where the step's time goes by kernel family, memory over time, and
how close each kernel comes to the device's ceiling; a PNG, and an HTML page that holds it."""

from __future__ import annotations

import base64
import html


def _figure(summary: dict, timeline, path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    fam = summary["families_ms"]
    names = list(fam)[::-1]
    axes[0].barh(names, [fam[n] for n in names], color="tab:orange")
    axes[0].set_xlabel("device ms")
    axes[0].set_title(f"time by family ({summary['total_ms']:.1f} ms in all)")
    ts, ys = timeline.curve()
    axes[1].step(ts, [y / 2 ** 20 for y in ys], where="post")
    axes[1].set_xlabel("ms")
    axes[1].set_ylabel("allocated MiB")
    axes[1].set_title("memory over time" if len(ts) > 1 else "memory over time (no allocator on this device)")
    ks = [(k, v["ceiling_fraction"]) for k, v in summary["kernels"].items() if v["ceiling_fraction"] is not None][:12]
    axes[2].barh([k for k, _ in ks][::-1], [100 * f for _, f in ks][::-1], color="tab:green")
    axes[2].set_xlabel("% of the device's ceiling (GEMM TFLOP/s or copy GB/s)")
    axes[2].set_title("kernels against the ceiling (by time)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(summary: dict, timeline, folder, title: str = "kiln profile") -> None:
    """report.png and report.html (the PNG inline, the kernel table, the allocation summary) in folder."""
    png = folder / "report.png"
    _figure(summary, timeline, png, title)
    rows = []
    for k, v in summary["kernels"].items():
        frac = "" if v["ceiling_fraction"] is None else f"{100 * v['ceiling_fraction']:.1f}"
        tf = f"{v['tflops']:.3f}" if v["flops"] and v["tflops"] is not None else ""
        gb = f"{v['gbps']:.1f}" if v["gbps"] is not None else ""
        rows.append(f"<tr><td>{html.escape(k)}</td><td>{v['calls']}</td><td>{v['ms']:.3f}</td>"
                    f"<td>{100 * v['ms'] / summary['total_ms']:.1f}</td><td>{tf}</td><td>{gb}</td><td>{frac}</td></tr>")
    a = summary["allocations"]
    c = summary.get("ceilings") or {}
    ceil = (f"GEMM {', '.join(f'{m} {t:.1f}' for m, t in c['gemm_tflops'].items())} TFLOP/s; copy "
            f"{c['copy_gbps']:.0f} GB/s ({html.escape(c['device'])}, measured {c['measured']})") if c else "not measured"
    img = base64.b64encode(png.read_bytes()).decode()
    (folder / "report.html").write_text(f"""<!doctype html><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}td,th{{padding:2px 8px;text-align:right}}td:first-child{{text-align:left}}</style>
<h1>{html.escape(title)}</h1>
<p>device time {summary['total_ms']:.2f} ms (kernels {summary['tracked_ms']:.2f}, outside them
{summary['untracked_ms']:.2f}); host {summary['host_ms']:.2f} ms; {summary['flops'] / 1e9:.2f} GFLOP.
Ceilings: {ceil}.</p>
<p>allocations: {a['allocs']} allocs, {a['frees']} frees, peak {a['peak_bytes'] / 2 ** 20:.1f} MiB
(trace in allocations.csv; the Chrome trace trace.json opens in ui.perfetto.dev)</p>
<img src="data:image/png;base64,{img}" style="max-width:100%">
<table><tr><th>kernel</th><th>calls</th><th>ms</th><th>%</th><th>TFLOP/s</th><th>GB/s</th><th>% ceiling</th></tr>
{''.join(rows)}</table>
""")
