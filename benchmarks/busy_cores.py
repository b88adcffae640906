"""How much of the machine a command keeps busy, sampled while it runs (Linux):

    python3 benchmarks/busy_cores.py [--every 5] [--log FILE] -- make test

Every `--every` seconds it reads the machine's CPU counters (/proc/stat: all time not idle and not
waiting for I/O counts as busy) and writes `unix-seconds busy-cores` to the log. At the end it
prints the command's wall seconds, the mean busy cores of the machine's cores, the share of
samples under one busy core and at full load, and the mean per 5 minutes. It exits with the
command's exit code.

What it answered: `make test` as one pytest process kept 1.07 of 2 cores busy on average (40% of
samples under one core), which is why `make test` now runs two pytest-xdist workers. The figure
is the whole machine's, so anything else running at the same time counts too.
"""
import argparse
import os
import statistics
import subprocess
import sys
import threading
import time


def _counters():
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values), values[3] + values[4]          # all, idle + iowait (in clock ticks)


def sample(every: float, log, stop: threading.Event, samples: list):
    total, idle = _counters()
    cores = os.cpu_count() or 1
    while not stop.wait(every):
        total2, idle2 = _counters()
        busy = cores * (1 - (idle2 - idle) / max(1, total2 - total))
        samples.append((time.time(), busy))
        if log:
            log.write(f"{time.time():.0f} {busy:.2f}\n")
            log.flush()
        total, idle = total2, idle2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--log", help="also write every sample to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    cores = os.cpu_count() or 1
    samples, stop = [], threading.Event()
    log = open(args.log, "a") if args.log else None
    sampler = threading.Thread(target=sample, args=(args.every, log, stop, samples), daemon=True)
    started = time.monotonic()
    sampler.start()
    code = subprocess.call(command)
    stop.set()
    sampler.join()
    seconds = time.monotonic() - started
    print(f"\nbusy_cores: {' '.join(command)!r} exited {code} after {seconds:.0f} s")
    if not samples:
        print("busy_cores: no sample (the command ended within one interval)")
        return code
    busy = [b for _, b in samples]
    print(f"  {len(busy)} samples every {args.every:g} s; mean {statistics.mean(busy):.2f} busy "
          f"cores of {cores}; {sum(b < 1 for b in busy) / len(busy):.0%} of samples under one "
          f"core, {sum(b > cores - 0.1 for b in busy) / len(busy):.0%} at {cores}")
    first = samples[0][0]
    per5 = {}
    for t, b in samples:
        per5.setdefault(int((t - first) // 300), []).append(b)
    print("  mean per 5 minutes: " + ", ".join(f"{statistics.mean(v):.2f}"
                                                for _, v in sorted(per5.items())))
    return code


if __name__ == "__main__":
    sys.exit(main())
