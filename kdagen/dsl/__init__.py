"""Device helpers the rendered kernels import: ``common`` (any arch), ``sm100`` (tcgen05).

Their source is part of every variant digest (``kdagen.render.digest``), so a change here
invalidates the compile cache like a template change does.
"""
