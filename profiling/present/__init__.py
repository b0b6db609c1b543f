"""Presentation: the report's sections (``report_sections``) and their display tables (``display``), HTML,
Markdown, TensorBoard and its plugin, the merged Chrome trace, the ``shardline profile`` CLI."""
