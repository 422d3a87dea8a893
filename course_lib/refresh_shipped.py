"""The refresh of the shipped models: `python -m course_lib.refresh_shipped [--methods A,B]`.

Trains the default models (or loads them from --checkpoints) and rewrites shipped_models/
(course_lib.shipping.refresh); --relabel renames them instead, training nothing. Not in
course_lib.shipping: training_lanes imports shipping, so the command using both sits above them."""

from __future__ import annotations

import argparse

from course_lib.core import settings
from course_lib.core.checkpoints import CHECKPOINTS
from course_lib.core.shipped import MANIFEST, SHIPPED_MODELS
from course_lib.shipping import SEED, refresh, relabel
from course_lib.training_lanes import add_jobs_option, checked_options, train_in_parallel


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--methods", default=None,
        help="comma-separated methods whose models are refreshed, e.g. 'vsepp,scan'; the other "
             "shipped models that are still current stay, the rest are listed as not shipped "
             "(default: every method)")
    add("--checkpoints", default=CHECKPOINTS,
        help="folder of cached trained models, shared with the benchmark and the notebooks: a "
             "finished model there is loaded, not trained (default: %(default)s)")
    add("--relabel", action="store_true",
        help="train nothing: move every shipped file to the name today's code gives it, byte for "
             "byte, after checking that it computes its recorded probe (a new naming rule alone)")
    add_jobs_option(parser)
    args = parser.parse_args(argv)
    only = checked_options(parser, args)
    if settings.smoke_mode():
        parser.error(f"the shipped models are the default models of seed {SEED}: "
                     "unset COURSE_SMOKE")
    settings.plain_course_notes()
    if args.relabel:
        manifest = relabel(SHIPPED_MODELS)
        print(f"relabelled {len(manifest['files'])} models in {SHIPPED_MODELS}")
        return manifest
    if args.jobs > 1:
        train_in_parallel(only, seed=SEED, checkpoints=args.checkpoints, jobs=args.jobs,
                          retrain=True)
    manifest = refresh(SHIPPED_MODELS, checkpoints=args.checkpoints, only=only)
    total = sum(entry["bytes"] for entry in manifest["files"].values())
    not_shipped = manifest["not_shipped"]
    print(f"wrote {len(manifest['files'])} models ({total / 1e6:.1f} MB) and {MANIFEST} to "
          f"{SHIPPED_MODELS}" + (f"; not shipped (trained on first use): {', '.join(not_shipped)}"
                                 if not_shipped else ""))
    return manifest


if __name__ == "__main__":
    main()
