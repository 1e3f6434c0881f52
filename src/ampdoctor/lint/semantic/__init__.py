"""What the linter knows about a file, organised by concept. Rules ask these modules; they
never compute such facts themselves and never import each other.

- ``autocast``  autocast calls (also through aliases and ``functools.partial``) and the regions
                that run around a node: lexical ``with``/decorator regions, and regions
                inherited from every in-file caller of the enclosing function.
- ``calls``     the file's call graph: functions, methods reached through ``self``/``cls``/
                ``super()``, module-level helpers, the callers of each and class overrides.
- ``vocabulary`` shared name heuristics: precision words, optimizer and scaler receivers.
- ``evidence``  one low-precision fact per function, class and file, with its strength
                (a model/weights cast to float16, a float16 flag or config, float16 autocast)
                that every numerics rule reads instead of scanning the file on its own.
- ``facts``     ``FileFacts``: the above, built lazily once per file and cached on the
                rule context (``facts_of(ctx)``).
"""
