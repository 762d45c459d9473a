/* kvtier fs tier: publish one chunk file in a single call, so the calling Python thread releases
 * the GIL once per file (ctypes) instead of once per system call.
 *
 * kvtier_write_chunk writes header + row to `tmp` (created exclusively with exactly `mode`, never
 * through a symlink), closes it and renames it over `final`; both names are relative to the
 * directory fd `dirfd`, which the caller opened without following links. Returns 0, or -errno of
 * the first failure; the temp file never outlives a failure.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

int kvtier_write_chunk(int dirfd, const char *tmp, const char *final, const void *hdr,
                       size_t hlen, const void *row, size_t rlen, int direct, int mode) {
    int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | (direct ? O_DIRECT : 0);
    int fd = openat(dirfd, tmp, flags, (mode_t)mode);
    if (fd < 0) return -errno;
    int err = fchmod(fd, (mode_t)mode) != 0 ? -errno : 0;
    struct iovec iov[2] = {{(void *)hdr, hlen}, {(void *)row, rlen}};
    struct iovec *cur = iov;
    int left = 2;
    off_t offset = 0;
    while (err == 0 && left > 0) {
        ssize_t n = pwritev(fd, cur, left, offset);
        if (n < 0) {
            if (errno == EINTR) continue;
            err = -errno;
            break;
        }
        if (n == 0) {
            err = -EIO;
            break;
        }
        offset += n;
        while (left > 0 && (size_t)n >= cur->iov_len) {
            n -= (ssize_t)cur->iov_len;
            cur++;
            left--;
        }
        if (left > 0) {
            cur->iov_base = (char *)cur->iov_base + n;
            cur->iov_len -= (size_t)n;
        }
    }
    if (close(fd) != 0 && err == 0) err = -errno;
    if (err == 0 && renameat(dirfd, tmp, dirfd, final) != 0) err = -errno;
    if (err != 0) unlinkat(dirfd, tmp, 0);
    return err;
}
