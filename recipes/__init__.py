"""shardline.recipes: recipe files, their schema and loader, the planner, and the ``shardline`` command."""
