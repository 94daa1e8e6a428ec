"""`python -m nanoserve.kernels`: build this install's CPU kernels now (make install runs it), for this CPU
or, with --baselines, for the named targets a machine without a compiler can load (the Docker image)."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from nanoserve.kernels import build
    p = argparse.ArgumentParser(prog="python -m nanoserve.kernels", description=__doc__)
    p.add_argument("--baselines", action="store_true",
                   help=f"build the portable targets ({', '.join(build.BASELINES)}) instead of this CPU's")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from nanoserve.kernels import cpu_kernels
    if not args.baselines:
        cpu_kernels.prepare()
        print("CPU kernels:", cpu_kernels.describe())
        # no compiler is no failure (the torch path runs, or a prebuilt build); a failed build is
        return 1 if cpu_kernels.load() is None and build.compiler() is not None else 0
    errors = []
    for target in build.BASELINES:  # one at a time: ninja compiles each one's sources side by side
        try:
            build.ensure_built(cpu_kernels.MODULE, target)
        except Exception as e:  # noqa: BLE001 - report every target's failure, then exit 1
            errors.append(f"{target}: {type(e).__name__}: {str(e).strip()[-500:]}")
    print("\n".join(errors) or f"baselines built into {build.kernels_dir()}",
          file=sys.stderr if errors else sys.stdout)
    return 1 if errors else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
