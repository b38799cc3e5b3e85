"""The composition root: the agent wired (:mod:`.agent`), started in order (:mod:`.startup`,
:mod:`.rest`, :mod:`.tuning`), supervised and shut down within its budget (:mod:`.supervisor`),
reloaded (:mod:`.reload`); what it decides from its settings and node (:mod:`.policy`)."""
