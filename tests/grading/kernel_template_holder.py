"""A grading worker stand-in for test_kernel_template.py: starts one sandbox whose kernel is
forked from the template at argv[1], prints what the test needs, then waits to be signalled.

    python kernel_template_holder.py TEMPLATE_PATH RUN_DIR
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "utils"))
from labkit.grading.sandbox import Limits, Sandbox  # noqa: E402


def main():
    box = Sandbox(sys.argv[2], limits=Limits(kernel_template=sys.argv[1]))
    box.start()
    ok = box.execute("1 + 1", timeout=60).status
    print(json.dumps({"forked": box.forked, "ok": ok, "namespace_pid": box.namespace_pid(),
                      "starter_pid": box.proc.pid, "uid": box.uid, "cgroups": box.cgroups}),
          flush=True)
    while True:                  # SIGTERM / SIGKILL from the test: no close() runs
        time.sleep(60)


if __name__ == "__main__":
    main()
