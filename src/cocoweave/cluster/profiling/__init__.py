"""Profiling a user's run (`cocoweave profile`): the step recorder each rank runs (`recorder`, started by
`rank_entry`), the local worlds measured (`worlds`), the host scaling model fitted on them (`host_scaling`), the
step MODELLED on catalog hardware (`hardware_model`), and the run profile document with its plot (`run_profile`,
`plot`)."""
