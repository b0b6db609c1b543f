"""Layout-independent checkpoints: canonical tensors cut into boxes (:mod:`.boxes`), the names a module's
parameters have in them (:mod:`.names`), the files with their atomic commit (:mod:`.files`) and their checked reads
(:mod:`.reader`). The strategy's save and load are :mod:`shardline.plugins.lightning.checkpointing`."""
