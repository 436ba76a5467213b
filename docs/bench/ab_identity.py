"""For the A/B scripts: the bench's summary also says, per mode, whether each prompt's output was the
target's (an A/B arm that is not the bench's own mode is outside its identity check)."""
import omnidraft.bench.runner as R


def check_identity() -> None:
    """Patch the bench's ``summarize`` to add ``identical_to_target`` and ``identical_prompts`` per mode."""
    orig = R.summarize

    def summarize(runs, baseline="target", **kw):
        out = orig(runs, baseline, **kw)
        if "target" in runs:
            for m in runs:
                same = [a.token_ids == b.token_ids for a, b in zip(runs[m], runs["target"])]
                out[m]["identical_to_target"] = all(same)
                out[m]["identical_prompts"] = sum(same)
        return out

    R.summarize = summarize
