"""Kernel side: the communication trace of a world, fetched from its ranks.

    with world.tracing() as trace:
        world.run(step)
    trace.ops(rank=0, op="all_reduce")   # records, see labkit.runtime.hooks for the fields
    trace.bytes_sent(rank=0)             # bytes rank 0 wrote to its sockets (gloo)
    trace.plot_timeline()                # one row per rank, one bar per op
"""


class Trace:
    def __init__(self, world):
        self.world = world
        self.records = []
        self.complete = True   # False if a rank restarted during the trace (its records are lost)

    def __enter__(self):
        for rank in range(self.world.size):
            self.world._control(rank, ("trace", True), "traced")
        return self

    def __exit__(self, *exc):
        records = []
        if self.world._broken or self.world._closed:
            self.complete = False
            return False
        for rank in range(self.world.size):
            records += self.world._control(rank, ("trace", False), "traced")["records"] or []
        self.records = sorted(records, key=lambda r: (r["t_start"], r["rank"]))
        return False

    def __len__(self):
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def ops(self, rank=None, op=None):
        """Records of one rank and/or one op name (`op` may also be a tuple of names)."""
        names = (op,) if isinstance(op, str) else op
        return [r for r in self.records
                if (rank is None or r["rank"] == rank) and (names is None or r["op"] in names)]

    def op_names(self, rank=None):
        return sorted({r["op"] for r in self.ops(rank)})

    def bytes_sent(self, rank, op=None):
        """Bytes the rank wrote to the wire during its ops (None if not countable here).

        Ops in flight together (isend + irecv) share one per-process counter, so this counts
        the union of their counter intervals: every byte once. With `op`, ops of other kinds
        that overlap the selected ones in time are counted too."""
        spans = [(r["wchar_start"], r["wchar_end"]) for r in self.ops(rank, op)]
        if any(start is None or end is None for start, end in spans):
            return None
        total, reached = 0, None
        for start, end in sorted(spans):
            if reached is not None and start < reached:
                start = reached
            if end > start:
                total += end - start
            reached = end if reached is None else max(reached, end)
        return total

    def tensor_bytes(self, rank, op=None):
        return sum(r["tensor_bytes"] for r in self.ops(rank, op))

    def table(self):
        """Rows of plain text, one per record, for printing."""
        t0 = min((r["t_start"] for r in self.records), default=0.0)
        rows = [f"{'rank':>4} {'seq':>4} {'op':<24} {'start ms':>9} {'dur ms':>8} "
                f"{'tensor B':>10} {'wire B':>10}"]
        for r in self.records:
            duration = "" if r["t_end"] is None else f"{(r['t_end'] - r['t_start']) * 1e3:8.2f}"
            wire = "" if r["wire_bytes_sent"] is None else str(r["wire_bytes_sent"])
            rows.append(f"{r['rank']:>4} {r['seq']:>4} {r['op']:<24} "
                        f"{(r['t_start'] - t0) * 1e3:9.2f} {duration:>8} "
                        f"{r['tensor_bytes']:>10} {wire:>10}")
        return "\n".join(rows)

    def plot_timeline(self, ax=None):
        """A matplotlib timeline: one row per rank, one bar per op, coloured by op."""
        import matplotlib.pyplot as plt
        if ax is None:
            _, ax = plt.subplots(figsize=(9, 0.5 + 0.5 * self.world.size))
        t0 = min((r["t_start"] for r in self.records), default=0.0)
        colours = {}
        for r in self.records:
            if r["t_end"] is None:
                continue
            colour = colours.setdefault(r["op"], f"C{len(colours) % 10}")
            ax.barh(r["rank"], (r["t_end"] - r["t_start"]) * 1e3, left=(r["t_start"] - t0) * 1e3,
                    color=colour, edgecolor="black", linewidth=0.3,
                    label=r["op"] if r["op"] not in ax.get_legend_handles_labels()[1] else None)
        ax.set_yticks(range(self.world.size))
        ax.set_yticklabels([f"rank {k}" for k in range(self.world.size)])
        ax.invert_yaxis()
        ax.set_xlabel("time since the first op (ms)")
        if colours:
            ax.legend(loc="upper right", fontsize="small")
        return ax
