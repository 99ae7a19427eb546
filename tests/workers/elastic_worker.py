"""A torchrun worker for tests/train/test_train_runner.py's elastic restart: the runner's command line,
with SIGKILL at chosen training steps of chosen attempts and ranks.

    MLKV_TEST_KILLS=ATTEMPT:RANK:STEP[,...] torchrun --max-restarts N tests/workers/elastic_worker.py CONFIG [OVERRIDES]

In attempt ATTEMPT (TORCHELASTIC_RESTART_COUNT), rank RANK kills itself right after its training
step STEP (counted from the step its run started or resumed at), before it logs or checkpoints.
"""
import os
import signal
import sys

from mlkv_torch.pipeline import LookaheadPipeline
from mlkv_torch.train import cli
from mlkv_torch.train.experiment import Experiment


def main() -> int:
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    kills = [tuple(int(x) for x in kill.split(":")) for kill in os.environ["MLKV_TEST_KILLS"].split(",")]
    kill_at = {step for a, r, step in kills if (a, r) == (attempt, rank)}
    step = [0]
    load = Experiment.load

    def load_and_note_the_step(self: Experiment) -> int:
        step[0] = load(self)
        return step[0]

    progress = LookaheadPipeline.progress

    def progress_then_maybe_die(self: LookaheadPipeline, data):
        out = progress(self, data)
        step[0] += 1
        if step[0] in kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    Experiment.load = load_and_note_the_step
    LookaheadPipeline.progress = progress_then_maybe_die
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
