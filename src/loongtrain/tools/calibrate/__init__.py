"""The planner's measuring side: ``loongtrain plan --calibrate`` (:mod:`.calibrate`: measure
this machine, write the ``local`` cluster), ``--validate`` (:mod:`.validate`: the
distributed attention's measured times against the planner's predictions) and
``--check-groups`` (:mod:`.groups`: a planned layout's groups built by ``init_parallel`` on
the fake backend) and ``--documents`` (:mod:`.per_batch`: what a layout per microbatch
would gain, priced with the attention's own layout code). Each module imports torch; this
package does not.
"""
