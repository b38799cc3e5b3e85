"""The composition root: the agent wired as an ordered list of parts (:mod:`.agent`), each of one
shape (:mod:`.part`) and a module of its own (:mod:`.parts`); supervised and shut down within its
budget (:mod:`.supervisor`), reloaded (:mod:`.reload`), probed (:mod:`.probes`), started with its
imports off the loop (:mod:`.tuning`); what more than one part decides from the settings and the
node (:mod:`.policy`)."""
