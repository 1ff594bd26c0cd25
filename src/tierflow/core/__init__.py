"""What every package shares, with no torch and no other tierflow package imported: the errors
(``errors.py``) and sizes (``units.py``) of the messages, the planner's settings
(``config.py``), directories checked before slow work (``paths.py``), seeds derived from
names (``seeding.py``), the page cache (``page_cache.py``) and torchrun's world size
(``torchrun_env.py``), each readable before torch is imported."""
