"""TorchRec's PrefetchTrainPipelineSparseDist over disk tables, on CUDA and on the CPU.

The pipeline runs batch i+1's input distribution during step i and calls each sharded module's
``prefetch`` with its result before step i's backward; the disk lookups answer by starting to
read the batch's rows (DiskGroupLookahead.prefetch), which stay staged until its forward. On CUDA,
TorchRec's pipeline does this on its own streams. Where there are none (the CPU), TorchRec's
prefetch step returns without prefetching and the next forward finds no input; `PrefetchPipeline`
runs the same step there without streams. Either way each forward reuses the input distribution
the prefetch waited for (LookaheadPipeline runs it a second time, but looks further ahead)."""
from __future__ import annotations

from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist
from torchrec.distributed.train_pipeline.pipeline_context import PrefetchTrainPipelineContext

__all__ = ["PrefetchPipeline"]


class PrefetchPipeline(PrefetchTrainPipelineSparseDist):
    """PrefetchTrainPipelineSparseDist (the same arguments and ``progress(dataloader_iter)``) that also
    prefetches where the device has no streams: on the CPU, each batch's input distribution is
    waited for and its rows prefetched one batch ahead, in the order TorchRec's CUDA path does."""

    def _prefetch(self, context: PrefetchTrainPipelineContext) -> None:
        if self._data_dist_stream is not None:
            super()._prefetch(context)
            return
        context.module_input_post_prefetch.clear()
        context.module_contexts_post_prefetch.clear()
        for module in self._pipelined_modules:
            name = module.forward._name
            dist_input = context.input_dist_tensors_requests.pop(name).wait()
            module_context = context.module_contexts.pop(name)
            module.prefetch(ctx=module_context, dist_input=dist_input, forward_stream=None)
            context.module_input_post_prefetch[name] = dist_input
            context.module_contexts_post_prefetch[name] = module_context
