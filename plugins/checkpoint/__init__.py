"""Layout-independent checkpoints: canonical tensors cut into boxes (:mod:`.boxes`), the names a module's
parameters have in them (:mod:`.names`), and the files with their atomic commit and checked reads (:mod:`.files`).
The strategy's save and load are :mod:`shardline.plugins.lightning.checkpointing`."""
