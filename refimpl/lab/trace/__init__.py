"""Where the time and memory went: profiler capture and labels (`profiling`), the allocator's
events (`memory_events`), one merged trace per run (`merge`), JSON views for viewers (`views`) and
the summary a profiled run leaves beside its traces (`run_record`)."""
