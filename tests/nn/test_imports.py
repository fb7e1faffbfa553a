"""Importing cocoweave.nn leaves torch's pipeline engine (and the DTensor it pulls in) for the first Pipeline."""

import subprocess
import sys


def test_importing_nn_does_not_import_the_pipeline_engine_until_a_pipeline_needs_it():
    code = ("import sys, cocoweave.nn\n"
            "print('torch.distributed.pipelining' in sys.modules, 'torch.distributed.tensor' in sys.modules)\n"
            "from cocoweave.nn.pipeline import SCHEDULES, CountingStage\n"
            "print(sorted(SCHEDULES), CountingStage.__mro__[1].__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "False False"
    assert out[1] == "['1f1b', 'gpipe', 'interleaved1f1b', 'loopedbfs'] PipelineStage"
