"""L5 application: training, tracking (own loops), report, doctor, bench, measure, profile, tune."""
