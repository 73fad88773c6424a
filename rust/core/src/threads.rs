//! Work shared among scoped threads, every thread joined before the call returns.
//!
//! `std::thread::scope` alone waits for the closures to finish, not for the threads to exit: a handle
//! that is never joined is detached, so its thread may still be running its exit (thread-local
//! destructors, glibc's `__cxa_thread_atexit_impl` list, allocated when a thread first registers one)
//! after the call has returned. Nothing is lost, but a caller that checks the heap at that moment (the
//! fuzz targets under LeakSanitizer do, after every input) sees those blocks as leaked. Joining each
//! handle returns only once its OS thread is gone, so a kernel leaves no thread of its behind.

/// Runs every task on a scoped thread of its own and joins them all; a task's panic is re-raised here
/// (as `std::thread::scope` does) once every thread has been joined.
pub(crate) fn run_joined<'env, F>(tasks: impl IntoIterator<Item = F>)
where
    F: FnOnce() + Send + 'env,
{
    std::thread::scope(|scope| {
        let handles: Vec<_> = tasks.into_iter().map(|task| scope.spawn(task)).collect();
        let mut panic = None;
        for handle in handles {
            if let Err(payload) = handle.join() {
                panic.get_or_insert(payload);
            }
        }
        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::run_joined;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_task_runs_once_on_borrowed_data() {
        let mut out = vec![0usize; 8];
        let calls = AtomicUsize::new(0);
        run_joined(out.chunks_mut(3).enumerate().map(|(t, share)| {
            let calls = &calls;
            move || {
                calls.fetch_add(1, Ordering::Relaxed);
                share.fill(t + 1);
            }
        }));
        assert_eq!(calls.load(Ordering::Relaxed), 3);
        assert_eq!(out, [1, 1, 1, 2, 2, 2, 3, 3]);
    }

    #[test]
    fn a_task_panic_reaches_the_caller_after_the_others_finish() {
        let done = AtomicUsize::new(0);
        let got = std::panic::catch_unwind(|| {
            run_joined((0..3).map(|i| {
                let done = &done;
                move || {
                    if i == 1 {
                        panic!("task 1");
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }))
        });
        assert!(got.is_err());
        assert_eq!(done.load(Ordering::Relaxed), 2);
    }
}
