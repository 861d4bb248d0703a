"""Problems: the record and its seeded sampler (``problems``), prompt rendering (``prompts``),
problem files read and validated (``files``, one row at a time in ``rows``), and the
``dapo data check`` / ``convert`` tools (``tools``)."""
