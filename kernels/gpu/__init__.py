"""The GPU itself: the hardware table (:mod:`.hardware`), the memory-bound copy kernel (:mod:`.copy`)
and the roofline arithmetic of the memory-hierarchy chapter (:mod:`.roofline`)."""
