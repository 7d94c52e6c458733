"""What a bench child is doing right now ("building the model", "step 0 backward
(compiling)", ...), in one place that the code changing it (systems.run_system) and the code
reporting it (the out-of-memory line, the pinned-allocator watch) both import: the phase
names where a child ran out of memory or grew a pinned block, which a traceback alone
does not (an allocation failure inside a compiled graph says nothing of which step)."""

phase = "setup"  # what the child was doing, for the out-of-memory line
