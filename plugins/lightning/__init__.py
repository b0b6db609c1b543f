"""The Lightning and DeepSpeed adapter: ``strategy`` (HybridParallelStrategy), ``registry`` (the registered
strategy names), ``pipeline_driver`` (DeepSpeed engines per pipeline stage), ``zero`` (the DeepSpeed config),
``profiler_callback`` (StepProfiler). The only package of shardline.plugins that imports Lightning or DeepSpeed.
"""
