"""``python -m ampfused``: what is built, for which torch, CUDA and archs, and where."""

import ampfused

print(ampfused.info())
