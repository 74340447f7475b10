"""The compiled decode: each batch bucket's program (Inductor / AOTInductor) built beside the eager one, timed
against it (verdict), cached on disk keyed by the code and the model, and swapped in when ready."""
